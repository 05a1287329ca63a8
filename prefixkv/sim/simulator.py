"""A model-free engine loop: the real Scheduler and KV manager driven by a cost model instead of a model.

Used for traces at scale (benchmarks of scheduling policies, tests of starvation bounds): every scheduled chunk
is "computed" instantly and charged overhead + per-token time, so a thousand-request trace runs in seconds. Hit
rates, waits in steps and preemptions are exact for the scheduler and cache as implemented; times are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixkv.config import EngineConfig
from prefixkv.engine.policies import SchedulingPolicy
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.scheduler import Scheduler
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.stats import percentile, ratio, summarize


@dataclass
class CostModel:
    """Time of one forward pass: a fixed part (weights read once per step) plus a part per batched token."""

    step_overhead_s: float = 0.010
    per_token_s: float = 0.0002

    def step_time(self, num_batched_tokens: int) -> float:
        return self.step_overhead_s + self.per_token_s * num_batched_tokens


@dataclass
class SimRequest:
    arrival_step: int
    prompt: list[int]
    output_len: int
    group: str = ""
    lora_id: str | None = None
    cache_salt: str | None = None


@dataclass
class SimResult:
    requests: list[Request] = field(default_factory=list)
    groups: dict[str, str] = field(default_factory=dict)  # request_id -> group
    wait_steps: dict[str, int] = field(default_factory=dict)  # request_id -> first admission step - arrival step
    wait_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    sim_seconds: float = 0.0
    computed_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0


def make_policy(name: str, max_wait_steps: int = 128) -> SchedulingPolicy:
    return create_policy(EngineConfig(schedule_policy=name, lpm_fallback_threshold=None, max_wait_steps=max_wait_steps))


def simulate(
    kv: KVCacheManager,
    policy: SchedulingPolicy,
    workload: list[SimRequest],
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 2048,
    cost: CostModel | None = None,
    max_steps: int = 100_000,
    check_every: int = 0,
) -> SimResult:
    """Drive the real Scheduler over a workload: each scheduled chunk is computed at once (the scheduler's
    update advances and commits it, as after a model step), a request whose sequence is fully computed samples a
    fresh token, and finishes after output_len of them."""
    cost = cost or CostModel()
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sched = Scheduler(config, kv, policy)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    res = SimResult()
    arrived_at: dict[str, float] = {}
    next_token = 10_000_000  # generated ids never collide with prompt ids or each other
    i = 0
    while i < len(pending) or sched.has_work():
        if sched.step_count >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        while i < len(pending) and pending[i].arrival_step <= sched.step_count:
            spec = pending[i]
            req = Request(
                f"{spec.group}{i}",
                list(spec.prompt),
                SamplingParams(max_tokens=spec.output_len),
                lora_id=spec.lora_id,
                cache_salt=spec.cache_salt,
            )
            req.max_tokens = spec.output_len
            sched.add(req)
            res.requests.append(req)
            res.groups[req.request_id] = spec.group
            arrived_at[req.request_id] = res.sim_seconds
            i += 1
        step = sched.step_count
        out = sched.schedule()
        for req, _ in out.scheduled:
            if req.request_id not in res.wait_steps:
                res.wait_steps[req.request_id] = step - req.arrival_step
                res.wait_s[req.request_id] = res.sim_seconds - arrived_at[req.request_id]
        res.sim_seconds += cost.step_time(out.num_batched_tokens) if out.scheduled else cost.step_overhead_s
        res.computed_tokens += out.num_batched_tokens
        sampled: list[int | None] = []
        for req, n in out.scheduled:  # a request whose sequence this step completes samples a fresh token
            sampled.append(next_token if req.num_computed_tokens + n == req.num_tokens else None)
            if sampled[-1] is not None:
                next_token += 1
        sched.update(out, sampled)
        for (req, _), token in zip(out.scheduled, sampled):
            if token is None:
                continue
            res.output_tokens += 1
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
        if check_every and step % check_every == 0:
            kv.check_invariants()
    res.steps = sched.step_count
    res.preemptions = sched.num_preemptions
    return res


def summarize_run(res: SimResult, kv: KVCacheManager) -> dict:
    """Hit rate over first admissions (what the offline bound is about), waits, simulated throughput."""
    prompt = sum(r.num_prompt_tokens for r in res.requests)
    hit = sum(max(r.num_cached_tokens, 0) for r in res.requests)
    waits = list(res.wait_steps.values())
    per_group: dict[str, list[int]] = {}
    for rid, w in res.wait_steps.items():
        per_group.setdefault(res.groups[rid], []).append(w)
    return {
        "token_hit_rate": ratio(hit, prompt),
        "hit_tokens": hit,
        "prompt_tokens": prompt,
        "cache_hit_rate": kv.stats.hit_rate,  # the cache's own gauge: first admissions, the same figure
        "readmission_hit_tokens": kv.stats.readmission_hits,  # preempted requests finding their pages again
        "readmission_tokens": kv.stats.readmission_queries,
        "computed_tokens": res.computed_tokens,
        "output_tokens": res.output_tokens,
        "steps": res.steps,
        "sim_seconds": res.sim_seconds,
        "sim_output_tok_s": ratio(res.output_tokens, res.sim_seconds),
        "sim_requests_per_s": ratio(len(res.requests), res.sim_seconds),
        "preemptions": res.preemptions,
        "wait_steps": summarize(waits),
        "wait_s": summarize(list(res.wait_s.values())),
        "p99_wait_steps": percentile(waits, 99),
        "max_wait_steps": max(waits, default=0),
        "mean_wait_steps_by_group": {g: sum(ws) / len(ws) for g, ws in sorted(per_group.items())},
    }
