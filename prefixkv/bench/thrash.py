"""`prefixkv bench thrash`: two hot prefixes, a pool that holds one, and what each scheduling policy makes of it.

Requests of group X (prefix X) and group Y (prefix Y) arrive interleaved, one every `--arrival-every` steps.
The pool holds one prefix plus the running requests' own pages, so serving X, Y, X, Y evicts each prefix just
before it is needed again (FCFS thrashes); serving the cached group first (LPM) keeps one prefix resident but
lets the other group wait as long as the first keeps arriving; bounded-lpm switches groups only when a request
has waited `--max-wait-steps` steps.

This benchmark is SIMULATED: the real Scheduler and KV manager run, but no model. Each step "computes" the
scheduled tokens instantly and is charged a cost-model time (overhead + per-token cost), so it runs in seconds
and its throughput numbers are cost-model numbers, not measurements. Hit rates, waits in steps and
preemptions are exact for the scheduler and cache as implemented.

Offline optimum: every request hits at most its group prefix (whole pages, never the last prompt token), and
the first request of each group must compute its prefix (a compulsory miss). Serving each group contiguously
achieves exactly that with a pool holding one prefix, so (requests - groups) full-prefix hits is both an upper
bound for any order (Belady's bound with only compulsory misses) and achievable offline.
"""

from __future__ import annotations

import argparse
import random
import time

from prefixkv.bench import common
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.outputs import RequestOutput
from prefixkv.sim.simulator import SimRequest, make_policy, simulate, summarize_run

POLICIES = ("fcfs", "lpm", "dfs-weight", "bounded-lpm", "k-lpm")
SIMULATED = "simulated: real scheduler and KV manager, no model; step time = overhead + per-token cost model"


# -- the thrash workload -----------------------------------------------------------------------------------------
def thrash_workload(
    requests_per_group: int = 64,
    prefix_len: int = 1024,
    suffix_len: int = 32,
    output_len: int = 16,
    arrival_every: int = 1,
    groups: int = 2,
    seed: int = 0,
) -> list[SimRequest]:
    rng = random.Random(seed)
    names = "XYZW"[:groups] if groups <= 4 else [f"G{g}" for g in range(groups)]
    prefixes = {g: [rng.randrange(1, 32000) for _ in range(prefix_len)] for g in names}
    out = []
    for k in range(requests_per_group * groups):
        g = names[k % groups]
        suffix = [rng.randrange(1, 32000) for _ in range(suffix_len)]
        out.append(SimRequest(k * arrival_every, prefixes[g] + suffix, output_len, g))
    return out


def optimal_hit_tokens(workload: list[SimRequest], prefix_len: int, page_size: int) -> int:
    """Compulsory misses only: all but the first request of each group hit their whole (page-aligned) prefix."""
    seen: set[str] = set()
    total = 0
    for spec in workload:
        if spec.group in seen:
            cap = min(prefix_len, len(spec.prompt) - 1)
            total += cap - cap % page_size
        seen.add(spec.group)
    return total


def pool_pages(prefix_len: int, suffix_len: int, output_len: int, max_num_seqs: int, page_size: int) -> int:
    """One prefix plus every running request's own pages (one page of slack each for the partial page)."""
    per_request = -(-(suffix_len + output_len) // page_size) + 1
    return -(-prefix_len // page_size) + max_num_seqs * per_request


# engine options the simulation honours; the on-model runs get the same, and every other engine option too
SIMULATED_OPTIONS = ("prefix_cache", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_wait_steps")
# engine options the benchmark sets itself: the policy from --policies, the pool from the workload (one prefix
# plus the running requests' pages), no FCFS fallback (the simulated policies have none)
_SET_HERE = ("schedule_policy", "kv_cache_tokens", "kv_cache_memory", "lpm_fallback_threshold")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "thrash", help="two hot prefixes, a pool holding one: hit rate and waits per policy (simulated, no model)"
    )
    p.add_argument("--requests-per-group", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--arrival-every", type=int, default=3, help="steps between arrivals (groups alternate)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--on-model",
        action="store_true",
        help="also run every policy on the real engine and model (same arrivals, same pool), timing it",
    )
    common.add_engine_args(
        p,
        exclude=_SET_HERE,
        aliases={"prefix_cache": ("--cache",)},
        defaults={
            "prefix_cache": "radix",
            "page_size": 16,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 2048,
            "max_wait_steps": 128,
            "seed": 0,
            "dtype": "bfloat16",
        },
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    """The simulated runs, and with --on-model the same on engines from llm_factory (default: the options')."""
    from prefixkv.bench.workloads import ratio

    workload = thrash_workload(
        args.requests_per_group, args.prefix_len, args.suffix_len, args.output_len, args.arrival_every, seed=args.seed
    )
    num_pages = pool_pages(args.prefix_len, args.suffix_len, args.output_len, args.max_num_seqs, args.page_size)
    optimal = optimal_hit_tokens(workload, args.prefix_len, args.page_size)
    prompt_tokens = sum(len(s.prompt) for s in workload)
    optimal_rate = ratio(optimal, prompt_tokens)
    results = {
        "mode": SIMULATED,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "num_pages": num_pages,
        "pool_tokens": num_pages * args.page_size,
        "optimal_token_hit_rate": optimal_rate,
        "optimal_how": "compulsory misses only: each group's first request computes the prefix, every other "
        "request hits it; achieved offline by serving each group contiguously",
        "policies": {},
    }
    rows = []
    for name in [s.strip() for s in args.policies.split(",") if s.strip()]:
        kv = create_kv_cache_manager(args.prefix_cache, num_pages, args.page_size)
        t0 = time.perf_counter()
        res = simulate(
            kv, make_policy(name, args.max_wait_steps), workload, args.max_num_seqs, args.max_num_batched_tokens
        )
        kv.check_invariants()
        s = summarize_run(res, kv)
        s["of_optimal"] = ratio(s["token_hit_rate"], optimal_rate)
        s["wall_s"] = time.perf_counter() - t0
        results["policies"][name] = s
        rows.append(
            [
                name,
                s["token_hit_rate"],
                s["of_optimal"],
                s["sim_output_tok_s"],
                s["p99_wait_steps"],
                s["max_wait_steps"],
                s["preemptions"],
                s["steps"],
            ]
        )
    common.print_table(
        ["policy", "hit rate", "of optimal", "sim out tok/s", "p99 wait (steps)", "max wait", "preempt", "steps"],
        rows,
        title=f"thrash ({SIMULATED}); {args.prefix_cache} cache, page {args.page_size}, pool "
        f"{num_pages * args.page_size} tokens; optimal hit rate {optimal_rate:.4f}",
    )
    if args.on_model:
        factory = common.factory_for(args, llm_factory)
        results["on_model"] = {}
        rows = []
        for name in results["policies"]:
            s = run_on_model(workload, name, args, num_pages, factory)
            s["of_optimal"] = ratio(s["token_hit_rate"], optimal_rate)
            results["on_model"][name] = s
            rows.append([name, s["token_hit_rate"], s["of_optimal"], s["output_tok_s"], s["p99_wait_s"], s["wall_s"]])
        common.print_table(
            ["policy", "hit rate", "of optimal", "output tok/s", "p99 wait s", "wall s"],
            rows,
            title=f"thrash on the model ({args.dtype}); same arrivals (in engine steps) and pool",
        )
    return results


def run_on_model(
    workload: list[SimRequest],
    policy: str,
    args: argparse.Namespace,
    num_pages: int,
    llm_factory: common.LLMFactory | None = None,
) -> dict:
    """The same arrivals on the real engine: a request arrives when the engine has taken its arrival step."""
    from prefixkv.bench.workloads import percentile, ratio
    from prefixkv.sampling_params import SamplingParams

    llm = common.factory_for(args, llm_factory)(
        **{name: getattr(args, name) for name in SIMULATED_OPTIONS},
        kv_cache_tokens=num_pages * args.page_size,
        schedule_policy=policy,
        lpm_fallback_threshold=None,
    )
    engine = llm.llm_engine
    pending = sorted(workload, key=lambda r: r.arrival_step)
    finished = []
    i = 0
    t0 = time.perf_counter()
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_step <= engine.scheduler.step_count:
            spec = pending[i]
            params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
            engine.add_request(f"{spec.group}{i}", {"prompt_token_ids": spec.prompt}, params)
            i += 1
        finished += [out for out in engine.step() if out.finished]
    wall = time.perf_counter() - t0
    prompt = sum(len(o.prompt_token_ids) for o in finished)
    waits = [_wait_s(o) for o in finished]
    output = sum(len(o.outputs[0].token_ids) for o in finished)
    return {
        "token_hit_rate": ratio(sum(o.num_cached_tokens for o in finished), prompt),
        "wall_s": wall,
        "output_tok_s": ratio(output, wall),
        "p99_wait_s": percentile(waits, 99),
        "requests": len(finished),
        "preemptions": engine.get_stats().num_preemptions,
    }


def _wait_s(out: RequestOutput) -> float:
    """Arrival to first scheduling: a finished request has been scheduled and carries its metrics."""
    metrics = out.metrics
    assert metrics is not None and metrics.first_scheduled_time is not None
    return metrics.first_scheduled_time - metrics.arrival_time


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["policies"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [results["policies"][n]["token_hit_rate"] for n in names])
    a.axhline(results["optimal_token_hit_rate"], color="k", linestyle="--", label="offline optimum")
    a.set_ylabel("token hit rate")
    a.legend()
    b.bar(names, [results["policies"][n]["p99_wait_steps"] for n in names])
    b.set_ylabel("p99 wait (steps)")
    fig.suptitle("thrash (simulated)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
