"""`prefixkv bench restart` and `prefixkv bench overflow`: what the KV offload tier (kv_offload_dir) buys.

restart: TTFT of a long system prompt + a short question, cold (nothing cached), warm in the pool (same server,
a second question), and warm after a restart (a NEW server process on the same tier directory, whose pool is
empty: the prefix comes back from disk). Real server processes over HTTP, as a user restarts one. Also the
tier's load bandwidth and per-page load cost (from /metrics) against the recompute cost per token (cold TTFT over
the prompt's tokens). The issue's target: warm-after-restart at least 10x below cold.

overflow: a working set of system prompts several times the pool (4x by default), visited round after round in
a shuffled order, one request at a time, with and without the tier: the pool alone can only miss (each prompt
is evicted before it comes back), the tier turns those misses into loads. Hit rate and TTFT per configuration.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from typing import Any

from prefixkv import engine_args
from prefixkv.bench import common
from prefixkv.bench.server_process import serve_process
from prefixkv.config import EngineConfig
from prefixkv.stats import median, ratio, summarize

MB = 1e6


def register(subparsers) -> None:
    p = subparsers.add_parser("restart", help="TTFT cold vs warm in the pool vs warm after a server restart (disk)")
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="system prompts measured (each its own cold/warm set)")
    p.add_argument("--tier-dir", default=None, help="tier directory (default: a temporary one, removed after)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    common.add_engine_args(p)
    p.set_defaults(func=run_restart)

    p = subparsers.add_parser("overflow", help="a working set of system prompts 4x the pool, with and without the tier")
    p.add_argument("--pool-tokens", type=int, default=8192, help="KV pool size in tokens")
    p.add_argument("--working-set", type=float, default=4.0, help="system prompts' tokens as a multiple of the pool")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="visits of every system prompt (the first is cold)")
    p.add_argument("--tier", choices=("disk", "host"), default="disk", help="the tier to compare with none")
    common.add_engine_args(p)
    p.set_defaults(func=run_overflow)


# -- restart ---------------------------------------------------------------------------------------------------
def run_restart(args: argparse.Namespace) -> dict:
    import httpx

    rng = random.Random(args.seed or 0)
    tokens = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]  # noqa: E731 - ordinary ids, no specials
    systems = [tokens(args.system_tokens) for _ in range(max(1, args.repeats))]
    questions = [[tokens(args.question_tokens) for _ in range(3)] for _ in systems]
    tier_dir = args.tier_dir or tempfile.mkdtemp(prefix="prefixkv-restart-")
    config = EngineConfig.from_kwargs(**{**engine_args.engine_kwargs(args), "kv_offload_dir": tier_dir})
    flags = _server_flags(args, tier_dir)
    phases: dict[str, list] = {"cold": [], "warm_in_pool": [], "warm_after_restart": []}
    cached: dict[str, list] = {k: [] for k in phases}
    try:
        with serve_process(flags, startup_timeout=args.startup_timeout) as base:
            _warm_up(httpx, base, tokens(64))
            for system, (qa, qb, _) in zip(systems, questions):
                for phase, q in (("cold", qa), ("warm_in_pool", qb)):
                    seconds, hit = _ttft(httpx, base, system + q)
                    phases[phase].append(seconds)
                    cached[phase].append(hit)
        # a new process: empty pool, same directory
        with serve_process(flags, startup_timeout=args.startup_timeout) as base:
            _warm_up(httpx, base, tokens(64))
            before = _metrics(httpx, base)
            for system, (_, _, qc) in zip(systems, questions):
                seconds, hit = _ttft(httpx, base, system + qc)
                phases["warm_after_restart"].append(seconds)
                cached["warm_after_restart"].append(hit)
            after = _metrics(httpx, base)
    finally:
        if args.tier_dir is None:
            shutil.rmtree(tier_dir, ignore_errors=True)

    loaded_bytes = after.get("loaded_bytes", 0.0) - before.get("loaded_bytes", 0.0)
    load_s = after.get("load_seconds", 0.0) - before.get("load_seconds", 0.0)
    loaded_tokens = after.get("hit_tokens", 0.0) - before.get("hit_tokens", 0.0)
    prompt_tokens = args.system_tokens + args.question_tokens
    ttft = {k: median(v) for k, v in phases.items()}
    recompute_per_token = ratio(ttft["cold"], prompt_tokens)
    load_per_token = ratio(load_s, loaded_tokens)
    results = {
        "config": {
            "system_tokens": args.system_tokens,
            "question_tokens": args.question_tokens,
            "repeats": len(systems),
            "dtype": config.dtype,
            "prefix_cache": config.prefix_cache,
            "page_size": config.page_size,
            "chunk_tokens": config.kv_offload_chunk_tokens,
            "num_threads": args.num_threads,
            "server_flags": flags,
        },
        "ttft_s": ttft,
        "ttft_samples_s": phases,
        "cached_tokens": cached,
        "speedup_restart_vs_cold": ratio(ttft["cold"], ttft["warm_after_restart"]),
        "speedup_pool_vs_cold": ratio(ttft["cold"], ttft["warm_in_pool"]),
        "target_speedup_restart": 10.0,
        "load": {
            "bytes": loaded_bytes,
            "seconds": load_s,
            "tokens": loaded_tokens,
            "mb_per_s": ratio(loaded_bytes / MB, load_s),
            "seconds_per_page": load_per_token * config.tokens_per_page,
            "seconds_per_token": load_per_token,
        },
        "recompute_seconds_per_token": recompute_per_token,
        "recompute_over_load_per_token": ratio(recompute_per_token, load_per_token),
    }
    _print_restart(results)
    return results


def _server_flags(args: argparse.Namespace, tier_dir: str) -> list[str]:
    """The engine options given on this command line, as `prefixkv serve` flags, plus the tier directory."""
    defaults = EngineConfig()
    flags = []
    for name, value in engine_args.engine_kwargs(args).items():
        if name == "enable_prefix_caching" or value is None or value == getattr(defaults, name, None):
            continue
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags + ["--kv-offload-dir", tier_dir]


def _warm_up(httpx, base: str, prompt: list[int]) -> None:
    """One short unrelated request: the first one pays for lazy torch initialisation."""
    _ttft(httpx, base, prompt)


def _ttft(httpx, base: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from sending a streamed max_tokens=1 completion to its first token, and its cached tokens."""
    body = {
        "model": httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, cached = None, 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if first is None and event.get("choices"):
                first = time.perf_counter() - start
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (first if first is not None else time.perf_counter() - start), cached


def _metrics(httpx, base: str) -> dict[str, float]:
    """The tier's counters from /metrics: prefixkv:kv_offload_<name> of the tier (not the pool)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if not line.startswith("prefixkv:kv_offload_") or 'tier="pool"' in line:
            continue
        series, value = line.partition("{")[0], line.rsplit(" ", 1)[1]
        out[series.removeprefix("prefixkv:kv_offload_").removesuffix("_total")] = float(value)
    return out


def _print_restart(r: dict) -> None:
    cfg, t, load = r["config"], r["ttft_s"], r["load"]
    common.print_table(
        ["phase", "TTFT s (median)", "cached tokens"],
        [(phase, t[phase], ",".join(map(str, r["cached_tokens"][phase]))) for phase in t],
        title=f"restart: {cfg['system_tokens']} + {cfg['question_tokens']} tokens, {cfg['dtype']}, "
        f"{cfg['repeats']} system prompts",
    )
    print(
        f"warm after restart vs cold: {r['speedup_restart_vs_cold']:.1f}x "
        f"(target >= {r['target_speedup_restart']:.0f}x); warm in pool vs cold: {r['speedup_pool_vs_cold']:.1f}x"
    )
    print(
        f"tier load: {load['mb_per_s']:.0f} MB/s, {load['seconds_per_page'] * 1000:.3f} ms per page; recompute: "
        f"{r['recompute_seconds_per_token'] * 1000:.3f} ms per token ({r['recompute_over_load_per_token']:.0f}x a load)"
    )


# -- overflow --------------------------------------------------------------------------------------------------
def run_overflow(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    factory = common.factory_for(args, llm_factory)
    on_mode = common.cache_mode_on(args)
    num_systems = max(2, round(args.working_set * args.pool_tokens / args.system_tokens))
    tier_dir = tempfile.mkdtemp(prefix="prefixkv-overflow-") if args.tier == "disk" else None
    try:
        tier_options: dict = {"kv_offload_chunk_tokens": args.kv_offload_chunk_tokens}
        if tier_dir is not None:
            tier_options.update(kv_offload_dir=tier_dir, kv_offload_size=args.kv_offload_size)
        else:
            tier_options.update(kv_offload_host_size=args.kv_offload_host_size or args.kv_offload_size)
        configs = {"pool only": {}, f"pool + {args.tier} tier": tier_options}
        runs = {}
        llm: Any = None
        for label, options in configs.items():
            llm = factory(prefix_cache=on_mode, kv_cache_tokens=args.pool_tokens, **options)
            try:
                runs[label] = _overflow_run(llm, args, num_systems)
            finally:
                if options:
                    llm.close()
    finally:
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)
    results = {
        "config": common.run_config(
            args,
            llm,
            prefix_cache_on=on_mode,
            pool_tokens=args.pool_tokens,
            system_tokens=args.system_tokens,
            question_tokens=args.question_tokens,
            num_system_prompts=num_systems,
            working_set_over_pool=num_systems * args.system_tokens / args.pool_tokens,
            rounds=args.rounds,
            tier=args.tier,
            chunk_tokens=args.kv_offload_chunk_tokens,
        ),
        "runs": runs,
    }
    _print_overflow(results)
    return results


def _overflow_run(llm, args: argparse.Namespace, num_systems: int) -> dict:
    """Every system prompt once per round, shuffled, one request at a time; the same seeded prompts for every
    configuration. Hit rate and TTFT after the first (cold) round."""
    from prefixkv.bench.workloads import sampler_for

    sampler = sampler_for(llm, seed=args.seed or 0)
    systems = [sampler.tokens(args.system_tokens) for _ in range(num_systems)]
    order_rng = random.Random(args.seed or 0)
    common.warmup(llm, sampler, prompt_len=args.system_tokens + args.question_tokens)
    ttfts, prompt_tokens, cached = [], 0, 0
    for round_index in range(max(2, args.rounds)):
        order = list(range(num_systems))
        order_rng.shuffle(order)
        for i in order:
            out = llm.generate([systems[i] + sampler.tokens(args.question_tokens)], common.greedy(1), use_tqdm=False)[0]
            if round_index == 0:
                continue
            ttfts.append(out.metrics.ttft)
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
    stats = llm.llm_engine.get_stats()
    return {
        "hit_rate": ratio(cached, prompt_tokens),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "ttft_s": summarize(ttfts),
        "tier_hit_tokens": stats.kv_tier_hit_tokens,
        "pool_hit_tokens": stats.kv_pool_hit_tokens,
        "tier_loaded_bytes": stats.kv_tier_loaded_bytes,
        "tier_load_seconds": stats.kv_tier_load_seconds,
        "tier_corrupt": stats.kv_tier_corrupt,
        "tier_dropped_saves": stats.kv_tier_dropped_saves,
    }


def _print_overflow(r: dict) -> None:
    cfg = r["config"]
    common.print_table(
        ["configuration", "hit rate", "TTFT median s", "TTFT p90 s", "tier hit tokens"],
        [
            (label, run["hit_rate"], run["ttft_s"]["median"], run["ttft_s"]["p90"], run["tier_hit_tokens"])
            for label, run in r["runs"].items()
        ],
        title=f"overflow: {cfg['num_system_prompts']} system prompts of {cfg['system_tokens']} tokens "
        f"({cfg['working_set_over_pool']:.1f}x a {cfg['pool_tokens']}-token pool), rounds 2..{cfg['rounds']}",
    )


def plot(results: dict, png_path: str) -> None:
    """restart: TTFT bars per phase (log scale); overflow: hit rate and median TTFT per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "runs" in results:
        labels = list(results["runs"])
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
        left.bar(labels, [results["runs"][k]["hit_rate"] for k in labels], color=["tab:orange", "tab:blue"])
        left.set_ylabel("hit rate (tokens, rounds after the first)")
        left.set_ylim(0, 1)
        right.bar(labels, [results["runs"][k]["ttft_s"]["median"] for k in labels], color=["tab:orange", "tab:blue"])
        right.set_ylabel("median TTFT (s)")
        cfg = results["config"]
        fig.suptitle(f"working set {cfg['working_set_over_pool']:.1f}x the pool", fontsize=10)
    else:
        t = results["ttft_s"]
        fig, ax = plt.subplots(figsize=(7, 4))
        bars = ax.bar(list(t), list(t.values()), color=["tab:gray", "tab:blue", "tab:green"])
        ax.bar_label(bars, labels=[f"{v * 1000:.0f} ms" for v in t.values()], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s, log scale)")
        cfg = results["config"]
        ax.set_title(f"{cfg['system_tokens']} + {cfg['question_tokens']} tokens ({cfg['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
