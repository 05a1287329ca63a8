"""One step for the engine and the simulator (engine/core.py): the same trace, scheduled the same, step by step.

The engine runs the model; the simulator runs a cost model in its place. Everything else of a step is the same
code, so on the same arrivals, pool and limits they must schedule the same chunks of the same requests, preempt
the same ones and finish in the same step: a probe component records each step's schedule in both.
"""

from __future__ import annotations

import random

import pytest

from prefixkv.config import EngineConfig
from prefixkv.engine.core import StepComponent
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.scheduler import SchedulerOutput
from prefixkv.sampling_params import SamplingParams
from prefixkv.sim.simulator import TOY_COST, Arrival, SimClock, Simulation, create_kv


class ScheduleProbe(StepComponent):
    """A step component that keeps what each step scheduled and preempted (no other effect)."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[tuple[str, int]], list[str]]] = []

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        self.steps.append(
            ([(r.request_id, n) for r, n in scheduled.scheduled], [r.request_id for r in scheduled.preempted])
        )


def _trace(seed: int) -> list[tuple[str, list[int], int]]:
    """(id, prompt, output tokens): 2 families behind 2 shared prefixes (40-70 tokens) and unrelated prompts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 20000) for _ in range(rng.randrange(40, 70))] for _ in range(2)]
    trace = []
    for i in range(10):
        head = prefixes[i % 2] if i % 3 else []
        prompt = head + [rng.randrange(100, 20000) for _ in range(rng.randrange(5, 40))]
        trace.append((f"r{i}", prompt, rng.randrange(2, 12)))
    return trace


@pytest.mark.parametrize("cache, policy, pool", [("hash", "fcfs", 1024), ("radix", "lpm", 256)])
def test_the_engine_and_the_simulator_schedule_a_trace_alike(new_llm, cache, policy, pool):
    """All requests arrive before the first step; a small pool (256 tokens: preemptions and evictions) or a
    roomier one, a 64-token budget (chunked prefill), at most 6 running."""
    limits = dict(
        prefix_cache=cache,
        schedule_policy=policy,
        kv_cache_tokens=pool,
        page_size=16,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    trace = _trace(seed=len(cache) + pool)

    llm = new_llm(**limits)
    engine = llm.llm_engine
    probe = ScheduleProbe()
    engine.core.components.append(probe)
    for rid, prompt, out in trace:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.check_invariants()

    config = EngineConfig(**limits)
    clock = SimClock()
    sim_probe = ScheduleProbe()
    sim = Simulation(
        config, create_kv(config, clock), create_policy(config), TOY_COST, clock="steps", sim_clock=clock,
        components=[sim_probe],
    )  # fmt: skip
    arrivals = [Arrival(0, rid, len(prompt), out, prompt.copy) for rid, prompt, out in trace]
    result = sim.run(arrivals)

    assert len(probe.steps) == len(sim_probe.steps) == result.steps
    for k, (ours, simulated) in enumerate(zip(probe.steps, sim_probe.steps)):
        assert ours == simulated, f"step {k}: the engine scheduled {ours}, the simulator {simulated}"
    assert sum(len(preempted) for _, preempted in probe.steps) == result.preemptions
    if pool == 256:
        assert result.preemptions > 0, "the small pool was meant to preempt"
