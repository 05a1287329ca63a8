"""`prefixkv bench schedule-cost`: how long one policy ordering of the waiting queue takes, per policy and cache.

SGLang orders by longest prefix match only up to 128 waiting requests because the check costs too much; this
measures ours at 128, 1024 and 4096 with no fallback. Three timings per case:
  cold   first ordering (hash keys and lookups computed for the first time)
  warm   the same queue again with the cache unchanged (memoised lookups)
  step   after a commit changed the cache, as between two engine steps (radix lookups are recomputed; the hash
         cache's per-request block keys stay memoised)
And the eviction policies' cost (--evictions): the same kind of requests served one at a time on a pool that holds
about half the prefixes, so nearly every admission evicts; the time of allocate() and free() (where eviction and
its bookkeeping happen) per request and per evicted page, and the hit rate each policy keeps.
Pure Python, no model; the times are real.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from prefixkv.engine.scheduler import admit_request
from prefixkv.kvcache.eviction import EVICTION_POLICIES
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.request import Request
from prefixkv.request_options import RequestOptions
from prefixkv.sim.simulator import make_policy

POLICIES = ("fcfs", "lpm", "dfs-weight", "bounded-lpm", "k-lpm")


def build(cache: str, n: int, num_prefixes: int, prefix_len: int, suffix_len: int, seed: int):
    """A cache warmed with num_prefixes prompts and n waiting requests extending them (or not)."""
    rng = random.Random(seed)
    ps = 16 if cache == "hash" else 1
    kv = create_kv_cache_manager(cache, (num_prefixes + 2) * (prefix_len + 64) // ps + 64, ps)
    prefixes = [[rng.randrange(1, 32000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    for i, p in enumerate(prefixes):
        warm = Request(f"warm{i}", p + [0], RequestOptions())
        kv.allocate(warm, warm.num_tokens, 0)
        warm.num_computed_tokens = warm.num_tokens
        kv.commit(warm)
        kv.free(warm)
    waiting = []
    for i in range(n):
        p = prefixes[rng.randrange(num_prefixes)]
        cut = rng.choice((prefix_len, prefix_len // 2, 0))
        req = Request(f"w{i}", p[:cut] + [rng.randrange(1, 32000) for _ in range(suffix_len)], RequestOptions())
        req.arrival_step = i // 8
        waiting.append(req)
    return kv, waiting


def change_cache(kv, k: int) -> None:
    """One commit, as every engine step makes: new pages enter the cache (radix lookups memoised before are stale)."""
    req = Request(f"change{k}", [40_000 + k] * 40, RequestOptions())
    kv.allocate(req, req.num_tokens, 0)
    req.num_computed_tokens = req.num_tokens
    kv.commit(req)
    kv.free(req)


def eviction_cost(
    cache: str, eviction: str, n: int, num_prefixes: int, prefix_len: int, suffix_len: int, seed: int
) -> dict:
    """n requests served one by one on a pool of about half the prefixes: every step evicts."""
    _, requests = build(cache, n, num_prefixes, prefix_len, suffix_len, seed)
    ps = 16 if cache == "hash" else 1
    kv = create_kv_cache_manager(
        cache, (num_prefixes // 2 + 1) * (prefix_len + suffix_len) // ps + 1, ps, eviction=eviction
    )
    evicting = total = 0.0
    for req in requests:
        t0 = time.perf_counter()
        cached = kv.lookup(req)
        t1 = time.perf_counter()
        assert admit_request(kv, req, req.num_tokens - cached, cached)
        t2 = time.perf_counter()
        req.num_computed_tokens = req.num_tokens
        kv.commit(req)
        t3 = time.perf_counter()
        kv.free(req)
        t4 = time.perf_counter()
        evicting += (t2 - t1) + (t4 - t3)
        total += t4 - t0
    evicted = kv.stats.evicted_pages
    return {
        "cache": cache,
        "eviction": eviction,
        "requests": n,
        "evicted_pages": evicted,
        "hit_rate": kv.stats.hit_rate,
        "alloc_free_us_per_request": evicting / n * 1e6,
        "alloc_free_us_per_evicted_page": evicting / evicted * 1e6 if evicted else 0.0,
        "request_us": total / n * 1e6,
    }


def time_order(policy, waiting, kv, step: int) -> float:
    t0 = time.perf_counter()
    policy.order(waiting, kv, step)
    return time.perf_counter() - t0


def register(subparsers) -> None:
    p = subparsers.add_parser("schedule-cost", help="time of one policy ordering at 128/1024/4096 waiting requests")
    p.add_argument("--sizes", default="128,1024,4096")
    p.add_argument("--caches", default="hash,radix")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--evictions", default=",".join(EVICTION_POLICIES), help="eviction policies to time (empty: none)")
    p.add_argument("--eviction-requests", type=int, default=1024, help="requests per eviction timing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from prefixkv.bench.common import print_table

    results: dict = {
        "mode": "real time of policy.order() and of eviction, no model",
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "cases": [],
        "eviction_cases": [],
    }
    rows = []
    for cache in [c.strip() for c in args.caches.split(",") if c.strip()]:
        for n in [int(x) for x in args.sizes.split(",") if x.strip()]:
            for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
                kv, waiting = build(cache, n, args.num_prefixes, args.prefix_len, args.suffix_len, args.seed)
                policy = make_policy(name)
                step = n // 8  # the oldest requests are past bounded-lpm's bound
                cold = time_order(policy, waiting, kv, step)
                warm = statistics.median(time_order(policy, waiting, kv, step) for _ in range(args.repeats))
                steps = []
                for k in range(args.repeats):
                    change_cache(kv, k)
                    steps.append(time_order(policy, waiting, kv, step))
                case = {
                    "cache": cache,
                    "waiting": n,
                    "policy": name,
                    "cold_ms": cold * 1e3,
                    "warm_ms": warm * 1e3,
                    "step_ms": statistics.median(steps) * 1e3,
                }
                results["cases"].append(case)
                rows.append([cache, n, name, case["cold_ms"], case["warm_ms"], case["step_ms"]])
    print_table(
        ["cache", "waiting", "policy", "cold ms", "warm ms", "step ms"],
        rows,
        title=f"schedule-cost: policy.order() with prefixes of {args.prefix_len} tokens",
    )
    rows = []
    for cache in [c.strip() for c in args.caches.split(",") if c.strip()]:
        for eviction in [e.strip() for e in args.evictions.split(",") if e.strip()]:
            case = eviction_cost(
                cache,
                eviction,
                args.eviction_requests,
                args.num_prefixes,
                args.prefix_len,
                args.suffix_len,
                args.seed,
            )
            results["eviction_cases"].append(case)
            rows.append(
                [
                    cache,
                    eviction,
                    case["evicted_pages"],
                    case["hit_rate"],
                    case["alloc_free_us_per_request"],
                    case["alloc_free_us_per_evicted_page"],
                    case["request_us"],
                ]
            )
    if rows:
        print()
        print_table(
            ["cache", "eviction", "evicted pages", "hit rate", "alloc+free us/req", "us/evicted page", "us/req"],
            rows,
            title=f"schedule-cost: eviction, {args.eviction_requests} requests served one at a time on a pool of "
            "about half the prefixes",
        )
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple, list] = {}
    for c in results["cases"]:
        series.setdefault((c["cache"], c["policy"]), []).append((c["waiting"], c["step_ms"]))
    for (cache, policy), pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy} / {cache}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("waiting requests")
    ax.set_ylabel("ms per ordering (after a cache change)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
