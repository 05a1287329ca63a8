"""`prefixkv bench flood`: one retained prefix under a flood of unrelated requests (issue 13's retention check).

A "hot" prefix (a long system prompt) is asked for by one request in every `--hot-every`; the first of them
retains it (`--retention-s`, priority 1), the later ones only use it. Between them come thousands of unrelated
prompts, a `--flood-retained` share of which also ask for retention (priority 0, `--flood-retention-s`), so the
retained share of the pool reaches its cap (`--retained-pool-fraction`) and the cap has to choose. The pool is
far smaller than the flood, so without retention LRU evicts the hot prefix between two of its uses.

What must hold (checked by the test, printed here): while the prefix is retained every hot request after the
first hits all of it (100%); after the deadline it decays to plain LRU (with the flood, it is evicted); retained
pages never exceed the cap; every request finishes (retention never starves admission). The same arrivals with
retention off are the baseline.

SIMULATED by default: the real Scheduler and KV manager on simulated time (retention deadlines run on it), no
model. `--on-model` replays a few hundred requests on the real engine (retention in wall-clock seconds).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixkv.bench import common
from prefixkv.config import EngineConfig
from prefixkv.engine.policy_factory import create_policy
from prefixkv.sim.simulator import TOY_COST, Arrival, SimClock, Simulation, create_kv
from prefixkv.stats import ratio

if TYPE_CHECKING:
    from prefixkv.llm import LLM

SIMULATED = "simulated: real scheduler and KV manager on simulated time, no model; step time = toy cost model"
# engine options the simulation honours; the on-model replay gets the same, and every other engine option too
SIMULATED_OPTIONS = (
    "prefix_cache",
    "page_size",
    "eviction",
    "kv_cache_tokens",
    "retained_pool_fraction",
    "max_num_seqs",
    "max_num_batched_tokens",
)
HOT = "hot"


@dataclass
class FloodSpec:
    prompt: list[int]
    arrival_s: float
    output_len: int
    group: str  # HOT or "flood"
    retention_s: float | None = None
    retention_priority: int = 0


def flood_workload(args: argparse.Namespace) -> list[FloodSpec]:
    rng = random.Random(args.seed)
    hot_prefix = [rng.randrange(1, 32000) for _ in range(args.prefix_len)]
    out: list[FloodSpec] = []
    t = 0.0
    first_hot = True
    for k in range(args.num_requests):
        t += args.arrival_every_s
        if k % args.hot_every == 0:
            suffix = [rng.randrange(1, 32000) for _ in range(args.suffix_len)]
            retention = args.retention_s if first_hot else None
            out.append(FloodSpec(hot_prefix + suffix, t, args.output_len, HOT, retention, 1))
            first_hot = False
            continue
        prompt = [rng.randrange(1, 32000) for _ in range(args.flood_len)]
        retained = rng.random() < args.flood_retained
        out.append(FloodSpec(prompt, t, args.output_len, "flood", args.flood_retention_s if retained else None, 0))
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "flood", help="one retained prefix under a flood of unrelated requests (simulated; --on-model: the engine)"
    )
    p.add_argument("--num-requests", type=int, default=6000, help="all requests, hot ones included")
    p.add_argument("--hot-every", type=int, default=50, help="one request in this many uses the hot prefix")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of the hot prefix")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--flood-len", type=int, default=512, help="tokens of each unrelated prompt")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--arrival-every-s", type=float, default=0.15, help="simulated seconds between arrivals")
    p.add_argument("--retention-s", type=float, default=400.0, help="the hot prefix's retention")
    p.add_argument("--flood-retained", type=float, default=0.3, help="share of flood requests asking for retention")
    p.add_argument("--flood-retention-s", type=float, default=30.0)
    p.add_argument("--on-model", action="store_true", help="also replay a shorter flood on the real engine")
    p.add_argument("--on-model-requests", type=int, default=300, help="with --on-model: requests on the engine")
    p.add_argument("--on-model-hot-every", type=int, default=10, help="with --on-model: --hot-every on the engine")
    common.add_engine_args(
        p,
        exclude=("kv_cache_memory",),  # the pool is --pool-tokens
        aliases={"prefix_cache": ("--cache",), "kv_cache_tokens": ("--pool-tokens",)},
        defaults={
            "retained_pool_fraction": 0.2,
            "kv_cache_tokens": 16384,
            "prefix_cache": "radix",
            "page_size": 16,
            "eviction": "lru",
            "max_num_seqs": 16,
            "max_num_batched_tokens": 2048,
            "seed": 0,
            "dtype": "bfloat16",
        },
    )
    p.set_defaults(func=run)


def _simulated_options(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in SIMULATED_OPTIONS}


def _config(args: argparse.Namespace, fraction: float) -> EngineConfig:
    return EngineConfig(**{**_simulated_options(args), "retained_pool_fraction": fraction})


def simulate_flood(args: argparse.Namespace, workload: list[FloodSpec], retention: bool) -> dict:
    """One run over the arrivals; retention False: the same arrivals with every retention field dropped."""
    config = _config(args, args.retained_pool_fraction if retention else 0.0)
    clock = SimClock()  # retention deadlines run on simulated time
    kv = create_kv(config, clock)
    max_retained = 0

    def sample(_: int) -> None:
        nonlocal max_retained
        max_retained = max(max_retained, len(kv.retention))

    sim = Simulation(config, kv, create_policy(config), TOY_COST, clock="seconds", on_done=sample, sim_clock=clock)
    arrivals = [
        Arrival(
            s.arrival_s,
            f"{s.group}{i}",
            len(s.prompt),
            s.output_len,
            s.prompt.copy,
            s.group,
            retention_seconds=s.retention_s if retention else None,
            retention_priority=s.retention_priority,
        )
        for i, s in enumerate(workload)
    ]
    t0 = time.perf_counter()
    res = sim.run(arrivals)
    kv.check_invariants()
    first_hot = next(s for s in workload if s.group == HOT)
    deadline = first_hot.arrival_s + args.retention_s  # the retention ends after this (it began at its commit)
    return _summary(
        args,
        [m for m in res.metrics if m.group == HOT],
        finished=sum(1 for m in res.metrics if not m.rejected),
        total=len(workload),
        deadline=deadline,
        admitted_at=lambda m: m.arrival_s + (m.queue_s or 0.0),
        hit=lambda m: m.hit_tokens,
        max_retained=max_retained,
        capacity=kv.retention.capacity,
        num_pages=kv.num_pages,
        extra={
            "sim_seconds": res.sim_seconds,
            "wall_s": time.perf_counter() - t0,
            "evicted_pages": kv.stats.evicted_pages,
            "retention_released_by_cap": kv.retention.released_by_cap,
            "max_wait_s": max((m.queue_s or 0.0 for m in res.metrics), default=0.0),
        },
    )


def _summary(args, hot, *, finished, total, deadline, admitted_at, hit, max_retained, capacity, num_pages, extra):
    """Hit rates of the hot prefix's later requests while retained and after, the retained share, completions."""
    full = args.prefix_len - args.prefix_len % args.page_size

    def rate(ms) -> float | None:
        return ratio(sum(1 for m in ms if hit(m) >= full), len(ms)) if ms else None

    later = hot[1:]  # the first computes the prefix: a compulsory miss
    during = [m for m in later if admitted_at(m) < deadline]
    after = [m for m in later if admitted_at(m) >= deadline]
    return {
        "hot_requests": len(hot),
        "hot_full_hit_rate_while_retained": rate(during),
        "hot_requests_while_retained": len(during),
        "hot_full_hit_rate_after_deadline": rate(after),
        "hot_requests_after_deadline": len(after),
        "max_retained_pages": max_retained,
        "retained_capacity_pages": capacity,
        "max_retained_share": ratio(max_retained, num_pages),
        "finished": finished,
        "requests": total,
        "all_finished": finished == total,
        **extra,
    }


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    """The simulated runs, and with --on-model the replay on an engine from llm_factory (default: the options')."""
    workload = flood_workload(args)
    results: dict[str, Any] = {
        "mode": SIMULATED,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "retention": simulate_flood(args, workload, retention=True),
        "no_retention": simulate_flood(args, workload, retention=False),
    }
    rows = [
        [
            name,
            r["hot_full_hit_rate_while_retained"],
            r["hot_full_hit_rate_after_deadline"],
            r["max_retained_share"],
            r["all_finished"],
            r["max_wait_s"],
        ]
        for name, r in (("retention", results["retention"]), ("no retention", results["no_retention"]))
    ]
    common.print_table(
        ["run", "hot hit rate (retained)", "hot hit rate (after)", "max retained share", "all finished", "max wait s"],
        rows,
        title=f"flood ({SIMULATED}); {args.num_requests} requests, {args.prefix_cache} cache, "
        f"pool {args.kv_cache_tokens} tokens, cap {args.retained_pool_fraction}",
    )
    if args.on_model:
        on_model = argparse.Namespace(**vars(args))
        on_model.num_requests, on_model.hot_every = args.on_model_requests, args.on_model_hot_every
        results["on_model"] = run_on_model(on_model, flood_workload(on_model), llm_factory=llm_factory)
        r = results["on_model"]
        common.print_table(
            ["on model", "hot hit rate (retained)", "max retained share", "all finished", "wall s"],
            [
                [
                    args.dtype,
                    r["hot_full_hit_rate_while_retained"],
                    r["max_retained_share"],
                    r["all_finished"],
                    r["wall_s"],
                ]
            ],
            title="flood on the model (wall-clock retention)",
        )
    return results


def run_on_model(
    args: argparse.Namespace,
    workload: list[FloodSpec],
    llm: LLM | None = None,
    llm_factory: common.LLMFactory | None = None,
) -> dict:
    """The arrivals on the real engine, in order, each added when the engine has run its arrival's share of
    steps (one request per step); retention in wall-clock seconds. llm: an LLM to use (tests pass a small one),
    else one from llm_factory (default: the options')."""
    from prefixkv.request_options import RequestOptions, Retention
    from prefixkv.sampling_params import SamplingParams

    if llm is None:
        llm = common.factory_for(args, llm_factory)(**_simulated_options(args))
    engine = llm.llm_engine
    kv = engine.kv
    hot: list[dict] = []
    max_retained = 0
    finished = 0
    t0 = time.perf_counter()
    deadline = None
    pending = list(enumerate(workload))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, spec = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
            engine.add_request(
                f"{spec.group}{i}",
                {"prompt_token_ids": spec.prompt},
                RequestOptions(params, retention=Retention(spec.retention_s, spec.retention_priority)),
            )
            if spec.group == HOT and deadline is None:
                deadline = time.monotonic() + args.retention_s
        for out in engine.step():
            if out.finished:
                finished += 1
                if out.request_id.startswith(HOT):
                    assert out.metrics is not None
                    hot.append({"at": out.metrics.first_scheduled_time or 0.0, "hit": out.num_cached_tokens})
        max_retained = max(max_retained, len(kv.retention))
    assert deadline is not None
    return _summary(
        args,
        hot,
        finished=finished,
        total=len(workload),
        deadline=deadline,
        admitted_at=lambda m: m["at"],
        hit=lambda m: m["hit"],
        max_retained=max_retained,
        capacity=kv.retention.capacity,
        num_pages=kv.num_pages,
        extra={"wall_s": time.perf_counter() - t0},
    )


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("retention", results["retention"]), ("no retention", results["no_retention"])]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(runs))
    a.bar([i - 0.2 for i in x], [r["hot_full_hit_rate_while_retained"] or 0 for _, r in runs], 0.4, label="retained")
    a.bar([i + 0.2 for i in x], [r["hot_full_hit_rate_after_deadline"] or 0 for _, r in runs], 0.4, label="after")
    a.set_xticks(list(x), [n for n, _ in runs])
    a.set_ylabel("hot prefix: share of full hits")
    a.legend()
    b.bar([n for n, _ in runs], [r["max_retained_share"] for _, r in runs])
    b.axhline(results["config"]["retained_pool_fraction"], color="k", linestyle="--", label="cap")
    b.set_ylabel("max retained share of the pool")
    b.legend()
    fig.suptitle("flood (simulated)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
