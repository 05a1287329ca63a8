"""`prefixkv simulate validate`: the simulator against the real engine on the same slice of a trace.

A cost model is only trusted as far as it was checked. This runs a small rescaled slice of a trace twice with the
same arrivals and the same engine settings (cache, page size, pool, policy, max_num_seqs, max_num_batched_tokens):
once through the real engine with wall-clock arrivals (in process: each request is added when its arrival time
has come, between steps, as a server's engine loop would see it), once through the simulator with the cost
model's clock; then prints TTFT and queueing percentiles of both and their ratio (simulated / real).

Both runs use the same scheduler and cache code, so they admit the same requests with the same prefix hits as
long as the clocks agree on which requests have arrived at each step; a difference in hits means the timing
differed enough to reorder a request against the step that computed (or evicted) its prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.sim_fit import StepTimer
from prefixkv.bench.workloads import sampler_for
from prefixkv.config import EngineConfig
from prefixkv.sim.cost_model import BatchShape, StepCostModel, load_cost_model
from prefixkv.sim.simulator import simulate_trace
from prefixkv.sim.traces import ScaledRequest, TraceScaling, load_trace, scale_trace
from prefixkv.stats import percentile, ratio

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(slots=True)
class Served:
    """One request's outcome in either run (seconds: wall clock for the engine, simulated for the simulator)."""

    prompt_tokens: int
    hit_tokens: int = 0
    ttft_s: float | None = None
    queue_s: float | None = None
    rejected: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="a Mooncake or Qwen-Bailian JSONL trace")
    parser.add_argument("--format", choices=("mooncake", "bailian"), default=None, help="default: detected")
    parser.add_argument("--tokens-per-block", type=int, default=16, help="tokens per trace block (512 = full length)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies arrival times (2.0 = half the load)")
    parser.add_argument("--output-scale", type=float, default=None, help="default: output lengths scale as prompts")
    parser.add_argument("--max-requests", type=int, default=40, help="the first N requests of the window")
    parser.add_argument("--start-s", type=float, default=0.0, help="the window starts at this trace second")
    parser.add_argument("--trace-seed", type=int, default=0, help="seed of the hash id -> token run mapping")
    parser.add_argument("--cost-model", required=True, help="a preset name or a JSON file from `simulate fit`")
    parser.add_argument("--output", default="validate.json", help="where the JSON result goes")
    common.add_engine_args(parser)
    parser.set_defaults(dtype="bfloat16")  # as `simulate fit`: compare with a cost model fitted on the same dtype


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> int:
    cost = load_cost_model(args.cost_model)  # bad input fails here, before the model loads
    if not os.path.isfile(args.trace):
        raise ValueError(f"--trace {args.trace}: no such file")
    scaling = TraceScaling(
        tokens_per_block=args.tokens_per_block,
        time_scale=args.time_scale,
        output_scale=args.output_scale,
        max_requests=args.max_requests,
        start_s=args.start_s,
    )
    trace = load_trace(args.trace, args.format)
    requests = scale_trace(trace, scaling, seed=args.trace_seed)
    scaling_text = scaling.describe(trace.block_size)
    print(f"{len(requests)} requests of {args.trace}: {scaling_text}", flush=True)

    llm: Any = common.factory_for(args, llm_factory)()
    engine = llm.llm_engine
    common.warmup(llm, sampler_for(llm))  # lazy torch initialisation is no request's TTFT
    engine.reset_prefix_cache()
    steps: list[tuple[BatchShape, float]] = []
    real = replay(engine, requests, steps)
    sim_config = simulator_config(engine)
    sim_result, _ = simulate_trace(sim_config, requests, cost)
    simulated = [
        Served(m.prompt_tokens, m.hit_tokens, m.ttft_s, m.queue_s, m.rejected)
        for m in sorted(sim_result.metrics, key=lambda m: int(m.request_id[1:]))  # "r<index>" in arrival order
    ]
    result = compare(real, simulated)
    result["real_steps"] = step_check(cost, steps)
    result |= {
        "trace": args.trace,
        "scaling": scaling_text,
        "cost_model": cost.to_json(),
        "engine": {k: v for k, v in dataclasses.asdict(sim_config).items() if v is not None},
        "model": engine.model_name,
    }
    print_comparison(result, cost.name)
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {args.output}")
    return 0


def replay(engine, requests: Sequence[ScaledRequest], steps: list | None = None) -> list[Served]:
    """The real engine on `requests` with wall-clock arrivals: each is added once its time has come (between
    steps: a request arriving mid-step waits for the step, in the engine as in the simulator), greedy with
    exactly output_len tokens; an idle engine sleeps until the next arrival. Per request, in arrival order.
    `steps`, when given, receives (shape, wall seconds) of every step that ran something."""
    timer = StepTimer(engine)
    try:
        return _replay(engine, timer, requests, steps if steps is not None else [])
    finally:
        timer.close()


def _replay(engine, timer: StepTimer, requests: Sequence[ScaledRequest], steps: list) -> list[Served]:
    served = [Served(r.prompt_len) for r in requests]
    pending = deque(enumerate(requests))
    index_of: dict[str, int] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[0][1].arrival_s <= now:
            i, r = pending.popleft()
            try:
                rid = engine.add_request(
                    f"validate-{i}", r.prompt_tokens(), common.greedy(r.output_len), arrival_time=start + r.arrival_s
                )
            except ValueError:  # too long for the pool or the model: the simulator rejects it too
                served[i].rejected = True
                continue
            index_of[rid] = i
        if not engine.has_unfinished_requests():
            if pending:
                time.sleep(max(0.0, start + pending[0][1].arrival_s - time.monotonic()))
            continue
        shape, seconds, _, outputs = timer.step()
        if shape.num_sequences:
            steps.append((shape, seconds))
        for out in outputs:
            if not out.finished or out.request_id not in index_of:
                continue
            record = served[index_of.pop(out.request_id)]
            record.hit_tokens = out.num_cached_tokens
            metrics = out.metrics
            record.ttft_s = metrics.ttft
            if metrics.first_scheduled_time is not None:
                record.queue_s = metrics.first_scheduled_time - metrics.arrival_time
    return served


def simulator_config(engine) -> EngineConfig:
    """The engine's own settings, with the pool and the context limit in the tokens the simulator counts."""
    return dataclasses.replace(
        engine.config,
        kv_cache_tokens=engine.kv.num_pages * engine.kv.page_size,
        kv_cache_memory=None,
        page_size=engine.kv.page_size,
        max_model_len=engine.max_model_len,
    )


def compare(real: Sequence[Served], simulated: Sequence[Served]) -> dict:
    """Percentiles of TTFT and queueing in both runs and their ratio (simulated / real), and both hit rates."""
    table: dict[str, dict] = {}
    for metric in ("ttft_s", "queue_s"):
        for p in PERCENTILES:
            r = percentile(_values(real, metric), p)
            s = percentile(_values(simulated, metric), p)
            table.setdefault(metric, {})[f"p{p}"] = {"real": r, "simulated": s, "ratio": ratio(s, r)}
    hits = {}
    for name, run in (("real", real), ("simulated", simulated)):
        served = [x for x in run if not x.rejected]
        prompt = sum(x.prompt_tokens for x in served)
        hit = sum(x.hit_tokens for x in served)
        hits[name] = {"hit_tokens": hit, "prompt_tokens": prompt, "token_hit_rate": ratio(hit, prompt)}
    differing = [i for i, (a, b) in enumerate(zip(real, simulated, strict=True)) if a.hit_tokens != b.hit_tokens]
    return {
        "requests": len(real),
        "rejected": {"real": sum(x.rejected for x in real), "simulated": sum(x.rejected for x in simulated)},
        "percentiles": table,
        "hit_rate": hits,
        "requests_with_different_hits": differing,
        "per_request": [
            {
                "real": dataclasses.asdict(a),
                "simulated": dataclasses.asdict(b),
            }
            for a, b in zip(real, simulated, strict=True)
        ],
    }


def step_check(cost: StepCostModel, steps: Sequence[tuple[BatchShape, float]]) -> dict:
    """The cost model on the real run's own steps: total measured vs predicted time, and the spread of the
    per-step ratio. Separates the cost model's error from its amplification by queueing in the TTFTs."""
    ratios = [cost.step_time(shape) / seconds for shape, seconds in steps]
    measured = sum(seconds for _, seconds in steps)
    predicted = sum(cost.step_time(shape) for shape, _ in steps)
    return {
        "steps": len(steps),
        "measured_s": measured,
        "predicted_s": predicted,
        "ratio": ratio(predicted, measured),
        "step_ratio": {f"p{p}": percentile(ratios, p) for p in (10, 50, 90)},
        "points": [  # the same records as `simulate fit` writes: a refit can use them
            {**dataclasses.asdict(shape), "seconds": seconds, "predicted_seconds": cost.step_time(shape)}
            for shape, seconds in steps
        ],
    }


def _values(run: Sequence[Served], metric: str) -> list[float]:
    return [v for x in run if not x.rejected and (v := getattr(x, metric)) is not None]


def print_comparison(result: dict, cost_name: str) -> None:
    rows = []
    for metric, label in (("ttft_s", "TTFT"), ("queue_s", "queueing")):
        for p, cell in result["percentiles"][metric].items():
            rows.append([f"{label} {p}", _ms(cell["real"]), _ms(cell["simulated"]), f"{cell['ratio']:.2f}"])
    common.print_table(
        ["", "real ms", "simulated ms", "sim / real"],
        rows,
        title=f"{result['requests']} requests: real engine vs simulator with cost model {cost_name}",
    )
    hits = result["hit_rate"]
    print(
        f"token hit rate: real {hits['real']['token_hit_rate']:.4f} ({hits['real']['hit_tokens']} tokens), "
        f"simulated {hits['simulated']['token_hit_rate']:.4f} ({hits['simulated']['hit_tokens']} tokens)"
    )
    check = result["real_steps"]
    spread = ", ".join(f"{k} {v:.2f}" for k, v in check["step_ratio"].items())
    print(
        f"cost model on the real run's {check['steps']} steps: measured {check['measured_s']:.1f} s, predicted "
        f"{check['predicted_s']:.1f} s (x{check['ratio']:.2f}); per-step predicted / measured: {spread}"
    )
    differing = result["requests_with_different_hits"]
    if differing:
        print(
            f"{len(differing)} request(s) got different hits ({differing[:10]}): the two clocks let a request "
            "arrive on different sides of the step that computed or evicted its prefix (same code, other timing)"
        )
    rejected = result["rejected"]
    if rejected["real"] or rejected["simulated"]:
        real, simulated = rejected["real"], rejected["simulated"]
        print(f"rejected (too long for the pool or the model): real {real}, simulated {simulated}")


def _ms(seconds: float) -> str:
    return "nan" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"
