"""`prefixkv bench routing`: `prefixkv serve --replicas N` on the model, one router against another, in one run.

Each round starts a fresh `prefixkv serve --replicas N --router R` (its own local Ray, N engine replicas of one
thread each, every replica's pool --kv-cache-tokens) per router, in alternating order, and drives it with `bench
serve`'s multi-tenant workload: --tenants system prompts whose sum overflows one replica's pool but fits in all N
together. Round-robin sends every tenant to every replica, so each pool thrashes through all the prompts; a
cache-aware router can keep each tenant on one replica. Reported per router: the hit rate the server reported
(usage.prompt_tokens_details), TTFT p50 / p90 and output tok/s, as medians over the rounds, and each router
against the first: the median of the per-round ratios (> 1: better), every round's listed. The machine's noise
moves TTFT from run to run: compare the routers within one run only.

Two more sides than routers: "R+store" is router R with every replica on one shared KV store (`--kv-remote` on a
redis-server this benchmark starts and empties before each run: docs/kv_remote.md), and "pooled" is one engine
with the N replicas' pools and threads together (`--replicas 1`): the cache no router can split, the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys

from prefixkv.bench.paired import paired
from prefixkv.bench.serve_client import add_arguments, run_async
from prefixkv.bench.server_process import serve_process, wait_for_replicas

READY_TIMEOUT_S = 600.0


def register(subparsers) -> None:
    p = subparsers.add_parser("routing", help="serve --replicas N on the model: round-robin vs precise routing")
    p.add_argument(
        "--routers",
        default="round-robin,precise",
        help="comma-separated, the first the baseline: router names, R+store (every replica on one shared KV "
        "store), pooled (one engine with all the replicas' pools and threads)",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="each round runs every router once, in alternating order")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-prompt-tokens", type=int, default=1024, help="approximate, per tenant (words)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument(
        "--kv-cache-tokens", type=int, default=3072, help="each replica's pool (default: two tenants' prompts fit)"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server logs (default: --output-dir)")
    p.set_defaults(func=run)


def _client_args(url: str, args: argparse.Namespace) -> argparse.Namespace:
    """`prefixkv bench serve --workload multi-tenant` against url, parsed by bench serve's own parser (its
    defaults stay its own)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {
        "--base-url": url,
        "--workload": "multi-tenant",
        "--tenants": args.tenants,
        "--num-requests": args.num_requests,
        "--concurrency": args.concurrency,
        "--system-prompt-tokens": args.system_prompt_tokens,
        "--output-tokens": args.output_tokens,
        "--timeout": 1200,
        "--seed": args.seed,
    }
    return parser.parse_args([*(str(x) for item in flags.items() for x in item), "--ignore-eos"])


POOLED = "pooled"
STORE_SUFFIX = "+store"


def _serve_args(side: str, args: argparse.Namespace, store_url: str | None) -> list[str]:
    """`prefixkv serve` flags for one side: N replicas behind a router (on the store for R+store), or pooled."""
    pooled = side == POOLED
    serve = ["--replicas", "1" if pooled else str(args.replicas), "--dtype", args.dtype]
    serve += ["--num-threads", str(args.replicas if pooled else 1)]
    serve += ["--kv-cache-tokens", str(args.kv_cache_tokens * (args.replicas if pooled else 1))]
    serve += ["--max-num-seqs", str(args.concurrency)]
    if not pooled:
        serve += ["--router", side.removesuffix(STORE_SUFFIX)]
    if side.endswith(STORE_SUFFIX):
        assert store_url is not None
        serve += ["--kv-remote", store_url]
    return serve


def run(args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as stack:
        store = None
        if any(r.strip().endswith(STORE_SUFFIX) for r in args.routers.split(",")):
            from prefixkv.kvcache.offload.store_process import RedisServer

            store = stack.enter_context(RedisServer(maxmemory="4gb"))
        return _run(args, store)


def _run(args: argparse.Namespace, store) -> dict:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    log_dir = args.log_dir or args.output_dir
    os.makedirs(log_dir, exist_ok=True)
    runs: dict[str, list[dict]] = {r: [] for r in routers}
    for round_index in range(args.rounds):
        order = routers if round_index % 2 == 0 else routers[::-1]
        for router in order:
            log_path = os.path.join(log_dir, f"routing_{router}_round{round_index}.log")
            if store is not None and router.endswith(STORE_SUFFIX):
                import redis

                redis.Redis.from_url(store.url).flushall()  # each side starts from an empty store
            serve_args = _serve_args(router, args, store.url if store is not None else None)
            with serve_process(serve_args, "/v1/models", READY_TIMEOUT_S, log_path) as url:
                if router != POOLED:
                    wait_for_replicas(url, args.replicas)
                summary = asyncio.run(run_async(_client_args(url, args)))
            if summary["num_errors"]:
                raise SystemExit(f"prefixkv bench routing: {router}: {summary['errors']}; see {log_path}")
            row = {
                "round": round_index,
                "hit_rate": summary["cached_fraction"],
                "ttft_p50_ms": summary["ttft_ms"]["p50"],
                "ttft_p90_ms": summary["ttft_ms"]["p90"],
                "output_tok_s": summary["output_throughput_tok_s"],
                "duration_s": summary["duration_s"],
            }
            runs[router].append(row)
            print(
                f"round {round_index} {router}: hit rate {row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                f"p90 {row['ttft_p90_ms']:.0f} ms, {row['output_tok_s']:.1f} output tok/s"
            )
    medians = {
        r: {
            k: statistics.median(x[k] for x in rows) for k in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "output_tok_s")
        }
        for r, rows in runs.items()
    }
    base = runs[routers[0]]
    vs_first = {  # round by round against the first router (> 1: better), then the median
        r: {
            k: paired([x[k] for x in rows], [x[k] for x in base], higher_is_better=not k.startswith("ttft"))
            for k in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "output_tok_s")
        }
        for r, rows in runs.items()
        if r != routers[0]
    }
    print(f"\nmedians of {args.rounds} rounds; against {routers[0]}: medians of per-round ratios (> 1: better)")
    print(f"{'router':<14}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'out tok/s':>11}{'p90 ratio':>11}")
    for r, m in medians.items():
        p90 = vs_first[r]["ttft_p90_ms"].median if r in vs_first else 1.0
        print(
            f"{r:<14}{m['hit_rate']:>10.1%}{m['ttft_p50_ms']:>13.0f}{m['ttft_p90_ms']:>13.0f}"
            f"{m['output_tok_s']:>11.1f}{p90:>11.2f}"
        )
    for r, metrics in vs_first.items():
        for k, p in metrics.items():
            print(f"  {r} vs {routers[0]}, {k}: {p.describe()}")
    config = {k: getattr(args, k) for k in ("replicas", "rounds", "tenants", "system_prompt_tokens", "num_requests")}
    config.update(
        concurrency=args.concurrency,
        output_tokens=args.output_tokens,
        kv_cache_tokens_per_replica=args.kv_cache_tokens,
        dtype=args.dtype,
        threads_per_replica=1,
        command="prefixkv " + " ".join(sys.argv[1:]),
    )
    paired_vs_first = {r: {k: p.as_dict() for k, p in m.items()} for r, m in vs_first.items()}
    return {"config": config, "routers": routers, "runs": runs, "medians": medians, "paired_vs_first": paired_vs_first}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = results["routers"]
    med = results["medians"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.6))
    a.bar(routers, [med[r]["hit_rate"] for r in routers])
    a.set_ylabel("prompt tokens served from cache")
    a.set_ylim(0, 1)
    x = range(len(routers))
    b.bar([i - 0.2 for i in x], [med[r]["ttft_p50_ms"] / 1000 for r in routers], width=0.4, label="p50")
    b.bar([i + 0.2 for i in x], [med[r]["ttft_p90_ms"] / 1000 for r in routers], width=0.4, label="p90")
    b.set_xticks(list(x), routers)
    b.set_ylabel("TTFT (s)")
    b.legend()
    c.bar(routers, [med[r]["output_tok_s"] for r in routers])
    c.set_ylabel("output tok/s")
    cfg = results["config"]
    fig.suptitle(
        f"serve --replicas {cfg['replicas']}: {cfg['tenants']} tenants x ~{cfg['system_prompt_tokens']}-token system "
        f"prompts, {cfg['kv_cache_tokens_per_replica']}-token pool per replica (median of {cfg['rounds']} rounds)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
