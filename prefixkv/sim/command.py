"""`prefixkv simulate` (one run) and `prefixkv simulate sweep` (a grid): a production trace replayed through the
real scheduler and KV cache on a simulated clock, reported beside the hit-rate bounds.

`prefixkv simulate fit` and `validate` live in prefixkv.bench (they run the model); prefixkv/cli.py wires them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence

from prefixkv.choices import KV_OFFLOAD_WRITE_POLICIES
from prefixkv.config import EngineConfig
from prefixkv.engine_args import add_engine_args, engine_kwargs
from prefixkv.router import policy_options
from prefixkv.sim import bounds, report
from prefixkv.sim.agent_traces import describe as describe_sessions
from prefixkv.sim.agent_traces import is_agent_trace, load_agent_trace
from prefixkv.sim.cause_check import World, check_causes
from prefixkv.sim.cost_model import PRESETS, StepCostModel, load_cost_model
from prefixkv.sim.replicas import POOLED, ROUTERS, simulate_replicas, summarize_replicas
from prefixkv.sim.shared_tier import default_shared_tier_cost
from prefixkv.sim.simulator import (
    NO_TENANCY,
    RequestMetrics,
    SimResult,
    Tenancy,
    simulate_trace,
    summarize_trace,
)
from prefixkv.sim.tier import TIER_PRESETS, SimTierOptions, default_tier_cost, load_tier_cost
from prefixkv.sim.traces import FORMATS, ScaledRequest, TraceScaling, load_trace, scale_trace

# EngineConfig fields the simulator does not model: the model's own take no flag; the second KV tier's and KV
# events' flags are refused with an error that says so (a flag that is recorded and does nothing would be a bug);
# every other field (cache, pool, policies, eviction, retention cap...) is a flag the simulator honours
_MODEL_ONLY = ("model", "dtype", "device", "weight_format", "kv_cache_memory", "num_threads", "seed", "kernel_options")
# trace requests carry no session hints (`simulate sessions` chooses its policies with --policies)
_NO_HINTS = ("session_policy",)
_NOT_SIMULATED = (
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "kv_events_topic",
    "kv_events_format",
    "kv_offload_dir",
    "kv_offload_size",
    "kv_offload_host_size",
    "kv_offload_chunk_tokens",
    "kv_offload_write_policy",
    "kv_offload_on_mismatch",
    "kv_remote",
    "kv_remote_timeout",
)


# the second tier's flags the simulator honours (its tier is simulated: sim/tier.py); the others name files or bytes
_TIER_HONOURED = ("kv_offload_chunk_tokens", "kv_offload_write_policy")


def refuse_unsimulated(p: argparse.ArgumentParser, honoured: Sequence[str] = ()) -> None:
    """The engine's flags the simulator does not model, each an error naming it (never a silent no-op)."""
    for name in _NOT_SIMULATED:
        if name not in honoured:
            flag = f"--{name.replace('_', '-')}"
            p.add_argument(flag, action=_NotSimulated, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_tier_arguments(group) -> None:
    """A simulated second tier's cost and chunks (its size is the caller's flag: a fraction of what it scales by)."""
    group.add_argument(
        "--tier-cost",
        default=None,
        help=f"the tier's KV bytes per token and bandwidths: a preset ({', '.join(TIER_PRESETS)}) or a JSON file "
        "(default: the one that goes with the cost model; this CPU's disk for a fitted one)",
    )
    group.add_argument(
        "--kv-offload-chunk-tokens",
        type=int,
        default=None,
        help="tokens per tier entry, a multiple of the page size (default 16: one page)",
    )
    group.add_argument(
        "--kv-offload-write-policy",
        choices=KV_OFFLOAD_WRITE_POLICIES,
        default=None,
        help="write_through (default): every computed chunk is saved; write_back: when the pool evicts it",
    )


def check_tier_flags(args: argparse.Namespace, with_tier: bool, size_flag: str) -> None:
    """The tier's flags only with a tier: a flag accepted and then ignored would be a bug."""
    given = [f for f in ("tier_cost", "kv_offload_chunk_tokens", "kv_offload_write_policy") if getattr(args, f, None)]
    if given and not with_tier:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ValueError(f"{flags}: there is no tier without {size_flag}")


def tier_options(args: argparse.Namespace, fraction: float, of_tokens: int, cost: StepCostModel) -> SimTierOptions:
    """A tier of `fraction` x `of_tokens`, in whole chunks, at --tier-cost (default: the cost model's)."""
    chunk = args.kv_offload_chunk_tokens or 16
    tokens = max(1, round(fraction * of_tokens / chunk)) * chunk
    tier_cost = load_tier_cost(args.tier_cost) if args.tier_cost else default_tier_cost(cost.name)
    return SimTierOptions(tokens, tier_cost, chunk, args.kv_offload_write_policy or "write_through")


def shared_tier_options(args: argparse.Namespace, of_tokens: int) -> SimTierOptions | None:
    """The shared tier --shared-tier-fraction asks for (that fraction of `of_tokens`, in whole chunks) at
    --shared-tier-cost (default: the store measured here at the nearest chunk size); None without it."""
    if args.shared_tier_cost and args.shared_tier_fraction is None:
        raise ValueError("--shared-tier-cost: there is no shared tier without --shared-tier-fraction")
    if args.shared_tier_fraction is None:
        return None
    if not args.shared_tier_fraction > 0:
        raise ValueError(f"--shared-tier-fraction must be > 0, got {args.shared_tier_fraction}")
    chunk = getattr(args, "kv_offload_chunk_tokens", None) or 16  # a sweep's tier: the engine's defaults
    cost = load_tier_cost(args.shared_tier_cost) if args.shared_tier_cost else default_shared_tier_cost(chunk)
    if cost.medium != "remote":
        raise ValueError(
            f"--shared-tier-cost {cost.name}: a shared store's cost has medium 'remote', not {cost.medium!r}"
        )
    tokens = max(1, round(args.shared_tier_fraction * of_tokens / chunk)) * chunk
    return SimTierOptions(tokens, cost, chunk, getattr(args, "kv_offload_write_policy", None) or "write_through")


def add_trace_arguments(p: argparse.ArgumentParser, tier: bool = False) -> None:
    """The trace, its scaling, the engine options the simulator honours, the cost model and the output (with
    `tier`: a simulated second tier's flags, whose chunk and write policy a shared tier takes too; the shared tier's
    own flags are always there)."""
    t = p.add_argument_group("trace")
    t.add_argument("--trace", help="JSON-lines trace file (required)")
    t.add_argument("--format", choices=sorted(FORMATS), default=None, help="trace format (default: detected)")
    t.add_argument(
        "--tokens-per-block",
        type=int,
        default=None,
        help="tokens each hash id stands for (default: the trace's own, i.e. full length, every token)",
    )
    t.add_argument("--output-scale", type=float, default=None, help="output lengths x this (default: as prompts)")
    t.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    t.add_argument("--start-s", type=float, default=0.0, help="slice: start at this trace second")
    t.add_argument("--duration-s", type=float, default=None, help="slice: this many trace seconds")
    t.add_argument("--trace-seed", type=int, default=0, help="seed of the hash id -> token ids mapping")
    add_engine_args(p, exclude=_MODEL_ONLY + _NOT_SIMULATED + _NO_HINTS, aliases={"prefix_cache": ("--cache",)})
    refuse_unsimulated(p, _TIER_HONOURED if tier else ())
    if tier:
        k = p.add_argument_group("second KV tier (simulated: sim/tier.py)")
        k.add_argument(
            "--tier-fraction",
            type=float,
            default=None,
            help="a second tier of this fraction of the scaled trace's unique prompt tokens behind the pool (one "
            "replica; default: none)",
        )
        add_tier_arguments(k)
    r = p.add_argument_group("shared KV tier (simulated: sim/shared_tier.py)")
    r.add_argument(
        "--shared-tier-fraction",
        type=float,
        default=None,
        help="one store of this fraction of the scaled trace's unique prompt tokens behind every replica's pool, "
        "as --kv-remote puts one behind every engine (default: none)",
    )
    r.add_argument(
        "--shared-tier-cost",
        default=None,
        help="the store's KV bytes per token, bandwidths and round trip: a preset of medium 'remote' or a JSON "
        "file (default: the Redis store measured on this machine, smollm2-redis-amd-epyc, at the nearest chunk "
        "size)",
    )
    s = p.add_argument_group("simulation")
    s.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=None,
        help="KV pool size as a fraction of the scaled trace's unique prompt tokens (instead of --kv-cache-tokens)",
    )
    s.add_argument(
        "--cost-model",
        default="smollm2-cpu-2t",
        help=f"a preset ({', '.join(PRESETS)}) or a JSON file written by `prefixkv simulate fit`",
    )
    s.add_argument("--no-bounds", action="store_true", help="skip the offline bound (it replays the trace once more)")
    s.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas behind a router, each with the pool the pool options give (default 1)",
    )
    s.add_argument(
        "--router",
        choices=ROUTERS,
        default="round-robin",
        help="how requests are spread over the replicas; 'pooled' is the bound: one engine with all replicas' pool "
        "and compute (default round-robin)",
    )
    s.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a routing policy option, e.g. decode_weight=1 or max_tree_tokens=1000000 (repeatable; numbers only)",
    )
    s.add_argument("--output-dir", default="sim_results", help="where the JSON results and the plot go")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--no-plot", action="store_true", help="write the JSON only")


class _NotSimulated(argparse.Action):
    """A flag of the engine the simulator does not model: an error naming it, never a silent no-op."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.dest.startswith("kv_remote"):
            parser.error(f"{option_string}: the simulator reaches no store (its shared tier: --shared-tier-fraction F)")
        what = "KV events" if "events" in self.dest else "second KV tier"
        parser.error(f"{option_string}: the simulator models no {what} (the engine's flag is not accepted here)")


def register(sub) -> argparse.ArgumentParser:
    """`simulate` with its run options, and its subcommands `sweep` (here) and the ones cli.py adds."""
    p = sub.add_parser(
        "simulate",
        help="replay a request trace through the real scheduler and caches on a simulated clock",
        description=__doc__,
        # no abbreviations: argparse matches them against every argument, so a subcommand's own flag (fit's
        # --output) would be an "ambiguous option" for this parser (--output-dir, --output-scale)
        allow_abbrev=False,
    )
    add_trace_arguments(p, tier=True)
    _sim_defaults(p)
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival times x this: 2 = half the load")
    p.add_argument(
        "--describe", action="store_true", help="print the trace's facts (and, for agent sessions, their hit rates)"
    )
    m = p.add_argument_group("miss causes (cache_miss.py)")
    m.add_argument(
        "--tenants",
        type=int,
        default=1,
        help="give the conversations this many cache salts (a conversation: the trace's session, else the "
        "requests sharing their first two blocks)",
    )
    m.add_argument(
        "--retention-seconds", type=float, default=None, help="retain every request's pages this long (simulated s)"
    )
    m.add_argument(
        "--retention-share",
        type=float,
        default=1.0,
        help="with --retention-seconds: only this share of the conversations retain (chosen by a hash)",
    )
    m.add_argument(
        "--check-causes",
        action="store_true",
        help="after the run, remove each cause it blamed (evicted, expired, isolated, routed) in a run of its own "
        "and report the share of the blamed tokens that run wins back",
    )
    p.set_defaults(func=run_command)
    return p


def _sim_defaults(p: argparse.ArgumentParser) -> None:
    """xxhash keys by default: the same hits as sha256 (no collisions at this scale), a fraction of the time."""
    p.set_defaults(prefix_caching_hash_algo="xxhash")


def register_sweep(simulate_sub) -> None:
    p = simulate_sub.add_parser(
        "sweep",
        help="a grid of pool sizes x schedule policies x evictions x time scales over one loaded trace",
        description="Runs the grid over one loaded trace; writes sweep.json and sweep.png and prints a table.",
    )
    add_trace_arguments(p)
    _sim_defaults(p)
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="pool sizes, fractions of the unique prompt tokens")
    p.add_argument("--policies", default=None, help="schedule policies (default: --schedule-policy)")
    p.add_argument("--evictions", default=None, help="eviction policies (default: --eviction)")
    p.add_argument("--time-scales", default="1", help="arrival-time multipliers (load = 1 / time scale)")
    p.add_argument("--routers", default=None, help=f"routers ({', '.join(ROUTERS)}; default: --router)")
    p.set_defaults(func=sweep_command)


def _split(text: str, kind: Callable = str) -> list:
    values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    if not values:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return values


def _scaling(args: argparse.Namespace, time_scale: float) -> TraceScaling:
    return TraceScaling(
        tokens_per_block=args.tokens_per_block,
        time_scale=time_scale,
        output_scale=args.output_scale,
        max_requests=args.max_requests,
        start_s=args.start_s,
        duration_s=args.duration_s,
    )


def router_options(args: argparse.Namespace) -> dict:
    """--router-option KEY=VALUE pairs as keyword arguments (ints where they read as ints)."""
    options: dict = {}
    for item in args.router_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--router-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"--router-option {key}: expected a number, got {value!r}") from None
    return options


def sim_engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the flags give, less the simulated tier's (the engine config names no tier)."""
    return {k: v for k, v in engine_kwargs(args).items() if k not in _TIER_HONOURED}


def _base_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags give, with a placeholder pool when the pool comes from --kv-cache-fraction."""
    kwargs = sim_engine_kwargs(args)
    if args.kv_cache_fraction is not None:
        if args.kv_cache_tokens is not None:
            raise ValueError("give --kv-cache-tokens or --kv-cache-fraction, not both")
        kwargs["kv_cache_tokens"] = None
    elif kwargs.get("kv_cache_tokens") is None and not getattr(args, "fractions", None):
        raise ValueError("the simulator needs a pool size: --kv-cache-tokens N or --kv-cache-fraction F")
    return EngineConfig.from_kwargs(**kwargs)


def pool_tokens(fraction: float, unique_tokens: int, page_size: int) -> int:
    """A pool of `fraction` of the unique prompt tokens, in whole pages (at least one)."""
    if not 0 < fraction:
        raise ValueError(f"--kv-cache-fraction must be > 0, got {fraction}")
    return max(1, round(fraction * unique_tokens / page_size)) * page_size


class _Progress:
    """A tqdm bar on stderr over the requests finished (disabled when stderr is not a terminal or with --quiet)."""

    def __init__(self, total: int, quiet: bool, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=quiet or not sys.stderr.isatty())

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _run_one(
    config: EngineConfig,
    requests: list[ScaledRequest],
    cost: StepCostModel,
    quiet: bool,
    desc: str,
    replicas: int = 1,
    router: str = "round-robin",
    router_options: dict | None = None,
    tenancy: Tenancy = NO_TENANCY,
    tier: SimTierOptions | None = None,
    shared_tier: SimTierOptions | None = None,
) -> tuple[dict, SimResult]:
    """One simulation: one engine (with a second tier if given), or `replicas` engines behind `router` (one
    replica needs no router), with one shared tier behind them all if given. Returns its summary and its
    requests' metrics (the fleet's, merged)."""
    t0 = time.perf_counter()
    with _Progress(len(requests), quiet, desc) as on_done:
        if replicas == 1 and shared_tier is None:
            res, kv = simulate_trace(config, requests, cost, on_done=on_done, tenancy=tenancy, tier=tier)
            summary = summarize_trace(res, kv)
        else:
            fleet = simulate_replicas(
                config,
                requests,
                cost,
                replicas,
                router,
                router_options,
                on_done=on_done,
                tenancy=tenancy,
                shared_tier=shared_tier,
            )
            summary = summarize_replicas(fleet)
            res = fleet.merged()
    summary["wall_s"] = time.perf_counter() - t0
    summary["replicas"], summary["router"] = replicas, router
    return summary, res


def _with_bounds(summary: dict, unbounded: dict, offline: dict | None) -> dict:
    summary["unbounded_hit_rate"] = unbounded["hit_rate"]
    summary["of_unbounded"] = summary["token_hit_rate"] / unbounded["hit_rate"] if unbounded["hit_rate"] else None
    if offline is not None:
        rate = offline["offline_hit_rate"]
        summary["offline_bound_hit_rate"] = rate
        summary["of_offline_bound"] = summary["token_hit_rate"] / rate if rate else None
    return summary


def unique_prompt_tokens(requests: Sequence[ScaledRequest]) -> int:
    """Distinct prompt token prefixes in the scaled trace: what a cache would hold to hit every shared prefix.
    A block is identified by its leading run of ids (a trie node); its tokens count once, at the longest length
    any prompt uses of it (a partial last block is a shorter run of the same tokens)."""
    trie: dict[tuple[int, int], int] = {}
    longest: dict[int, int] = {}
    for req in requests:
        node, per_block = 0, req.tokens_per_block
        for k, block in enumerate(req.block_ids):
            node = trie.setdefault((node, block), len(trie) + 1)
            used = min(per_block, req.prompt_len - k * per_block)
            if longest.get(node, 0) < used:
                longest[node] = used
    return sum(longest.values())


def _unbounded(acc: bounds.PageAccesses) -> dict:
    b = bounds.unbounded_hit_tokens(acc, acc.page_size)
    return {"hit_tokens": b.hit_tokens, "prompt_tokens": b.prompt_tokens, "hit_rate": b.rate}


def _offline(acc: bounds.PageAccesses, pool: int) -> dict:
    t0 = time.perf_counter()
    b = bounds.offline_hit_tokens(acc, acc.page_size, pool // acc.page_size)
    return {
        "pool_tokens": pool,
        "offline_hit_tokens": b.hit_tokens,
        "offline_hit_rate": b.rate,
        "wall_s": time.perf_counter() - t0,
    }


def _require_trace(args: argparse.Namespace) -> None:
    if not args.trace:
        raise ValueError("--trace FILE is required")
    if not os.path.isfile(args.trace):
        raise ValueError(f"--trace {args.trace}: no such file")


def _options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not callable(v)}


def run_command(args: argparse.Namespace) -> int:
    """One run: load, scale, simulate, compare with the bounds; print, and write simulate.json + simulate.png."""
    if args.describe:
        return describe_command(args)
    _require_trace(args)
    cost = load_cost_model(args.cost_model)
    base = _base_config(args)
    trace = load_trace(args.trace, args.format)
    scaling = _scaling(args, args.time_scale)
    requests = scale_trace(trace, scaling, seed=args.trace_seed)
    page = base.tokens_per_page
    unique = unique_prompt_tokens(requests)
    if args.kv_cache_fraction is not None:
        pool = pool_tokens(args.kv_cache_fraction, unique, page)
    else:
        assert base.kv_cache_tokens is not None  # _base_config checked it
        pool = base.kv_cache_tokens
    config = dataclasses.replace(base, kv_cache_tokens=pool)
    described = scaling.describe(trace.block_size)
    print(f"trace {args.trace}: {len(requests)} requests, {described}; {unique} unique prompt tokens", flush=True)
    print(f"pool {pool} tokens ({pool / unique:.1%} of unique), cost model {cost.name}", flush=True)
    if args.replicas > 1:
        print(f"{args.replicas} replicas of that pool behind the {args.router} router", flush=True)
    tier = None
    shared = shared_tier_options(args, unique)
    if args.tier_cost and args.tier_fraction is None:
        raise ValueError("--tier-cost: there is no tier without --tier-fraction")
    check_tier_flags(
        args, args.tier_fraction is not None or shared is not None, "--tier-fraction or --shared-tier-fraction"
    )
    if args.tier_fraction is not None and shared is not None:
        raise ValueError(
            "--tier-fraction with --shared-tier-fraction: a local tier in front of the store is not simulated"
        )
    if shared is not None:
        print(f"shared tier {shared.capacity_tokens} tokens behind every replica ({shared.cost.name})", flush=True)
    if args.tier_fraction is not None:
        if args.replicas > 1:
            raise ValueError("--tier-fraction: the simulated tier sits behind one engine (--replicas 1)")
        if not args.tier_fraction > 0:
            raise ValueError(f"--tier-fraction must be > 0, got {args.tier_fraction}")
        tier = tier_options(args, args.tier_fraction, unique, cost)
        print(f"second tier {tier.capacity_tokens} tokens ({tier.cost.name})", flush=True)
    accesses = bounds.page_accesses(requests, page)
    unbounded = _unbounded(accesses)
    kv_tokens = pool * args.replicas + sum(t.capacity_tokens for t in (tier, shared) if t)
    offline = None if args.no_bounds else _offline(accesses, kv_tokens)  # the bound of all the KV there is
    options = router_options(args)
    tenancy = Tenancy(args.tenants, args.retention_seconds, args.retention_share)
    summary, res = _run_one(
        config, requests, cost, args.quiet, "simulate", args.replicas, args.router, options, tenancy, tier, shared
    )
    summary = _with_bounds(summary, unbounded, offline)
    checks = None
    if args.check_causes:

        def rerun(world: World) -> tuple[dict, list[RequestMetrics]]:
            router = world.router or args.router
            removed, removed_res = _run_one(
                world.config,
                requests,
                cost,
                args.quiet,
                "no cause",
                args.replicas,
                router,
                options,
                world.tenancy,
                tier,
                shared,
            )
            return removed, removed_res.metrics

        world = World(config, tenancy, args.router if args.replicas > 1 else None)
        checks = check_causes(summary, res.metrics, world, requests, unique, rerun)
    results = {
        "command": "simulate",
        "trace": {"path": args.trace, "format": trace.format, "block_size": trace.block_size},
        "scaling": described,
        "unique_prompt_tokens": unique,
        "pool_tokens": pool,
        "pool_fraction_of_unique": pool / unique if unique else None,
        "engine_config": dataclasses.asdict(config),
        "cost_model": cost.to_json(),
        "tier": dataclasses.asdict(tier) if tier else None,
        "shared_tier": dataclasses.asdict(shared) if shared else None,
        "options": _options(args),
        "bounds": {"unbounded": unbounded, "offline": offline},
        "summary": summary,
        "cause_checks": checks,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(_run_table(summary))
    if checks is not None:
        print(_checks_table(checks))
    _write_results(results, args.output_dir, "simulate.json")
    png = os.path.join(args.output_dir, "simulate.png")
    title = f"{os.path.basename(args.trace)}: {described}\n{config.prefix_cache} cache, pages of {page}, pool {pool} "
    title += f"tokens, {config.schedule_policy}, cost model {cost.name}"
    if args.replicas > 1:
        title += f", {args.replicas} replicas, {args.router} router"
    if shared is not None:
        title += f", shared tier {shared.capacity_tokens} tokens"
    if not args.no_plot:
        ttfts = [m.ttft_s for m in res.metrics if m.ttft_s is not None]
        queues = [m.queue_s for m in res.metrics if m.queue_s is not None]
        _try_plot(lambda: report.plot_run(summary, ttfts, queues, title, png), png)
    return 0


def describe_command(args: argparse.Namespace) -> int:
    """--describe: the trace's facts. Agent sessions (a directory or one .json file): sessions, requests, tokens
    and each session's hit rate with an unbounded cache; a JSON-lines trace: requests, span, lengths, and the
    unbounded-cache hit rate at its own block size."""
    if not args.trace:
        raise ValueError("--trace PATH is required")
    if is_agent_trace(args.trace):
        facts = describe_sessions(load_agent_trace(args.trace))
    else:
        _require_trace(args)
        trace = load_trace(args.trace, args.format)
        reqs = trace.requests
        scaled = scale_trace(trace, TraceScaling(), seed=args.trace_seed)
        facts = {
            "format": trace.format,
            "requests": len(reqs),
            "span_s": reqs[-1].arrival_s - reqs[0].arrival_s,
            "input_tokens": sum(r.input_length for r in reqs),
            "mean_input_tokens": sum(r.input_length for r in reqs) / len(reqs),
            "mean_output_tokens": sum(r.output_length for r in reqs) / len(reqs),
            "max_input_tokens": max(r.input_length for r in reqs),
            "unbounded_hit_rate": bounds.unbounded_hit_tokens(scaled, trace.block_size).rate,
        }
    print(report.format_table(["fact", "value"], [[k, v] for k, v in facts.items()]))
    return 0


def _run_table(s: dict) -> str:
    rows = [
        ["token hit rate", s["token_hit_rate"]],
        ["unbounded-cache hit rate", s["unbounded_hit_rate"]],
        ["offline bound (all replicas' pool, and the tier)", s.get("offline_bound_hit_rate", "skipped")],
        ["achieved / offline bound", s.get("of_offline_bound", "skipped")],
        ["TTFT p50 / p90 / p99 (sim s)", _ps(s["ttft_s"])],
        ["queueing p50 / p90 / p99 (sim s)", _ps(s["queue_s"])],
        ["output tok/s, req/s (sim)", f"{s['output_tok_s']:.1f}, {s['requests_per_s']:.3f}"],
        ["evicted pages, preemptions", f"{s['evicted_pages']}, {s['preemptions']}"],
        ["missed prompt tokens by cause", _causes(s)],
        ["served, rejected requests", f"{s['served_requests']}, {s['rejected_requests']}"],
        ["replicas, router", f"{s['replicas']}, {s['router']}"],
        ["simulated span (s), steps, wall (s)", f"{s['sim_seconds']:.1f}, {s['steps']}, {s['wall_s']:.1f}"],
    ]
    if "tier" in s:
        rows.insert(9, ["tier hit tokens, read stall (sim s)", f"{s['tier_hit_tokens']}, {s['tier_stall_s']:.2f}"])
    if "shared_tier_hit_tokens" in s:
        stall = f"{s['shared_tier_hit_tokens']}, {s['shared_tier_stall_s']:.2f}"
        rows.insert(9, ["shared tier hit tokens, read + probe stall (sim s)", stall])
    if "busy_max_over_mean" in s:
        ratios = (s["busy_max_over_mean"], s["routed_max_over_mean"], s["in_flight_max_over_mean"])
        rows.append(["load max / mean: busy time, requests routed, in flight", ", ".join(map(_ratio, ratios))])
    return report.format_table(["metric", "value"], rows)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _checks_table(rows: list[dict]) -> str:
    """The evidence per cause: the share of its blamed tokens the run without it wins back, and the net change."""
    cells = [
        [
            "+".join(r["removes"]),
            r["without"],
            r["blamed_tokens"],
            r["won_back_tokens"],
            f"{r['recovered_share']:.1%}",
            f"{r['net_hit_tokens']:+d}" + ("" if r["same_requests"] else " *"),
            f"{r['net_share']:+.1%}",
        ]
        for r in rows
    ]
    headers = ["cause", "the run without it", "blamed tokens", "won back", "share", "net hit change", "net / blamed"]
    note = "\n* that run served other requests (a larger pool took ones this run rejected)"
    return report.format_table(headers, cells) + ("" if all(r["same_requests"] for r in rows) else note)


def _causes(s: dict) -> str:
    missed = s["prompt_tokens"] - s["hit_tokens"]
    shares = [f"{cause} {tokens / missed:.1%}" for cause, tokens in s["missed_tokens_by_cause"].items() if tokens]
    return ", ".join(shares)


def _ps(d: dict) -> str:
    return " / ".join("nan" if v is None or v != v else f"{v:.3f}" for v in (d["p50"], d["p90"], d["p99"]))


def _write_results(results: dict, output_dir: str, name: str) -> None:
    path = os.path.join(output_dir, name)
    report.write_json(results, path)
    print(f"results written to {path}")


def _try_plot(draw: Callable[[], None], png: str) -> None:
    try:
        draw()
        print(f"plot written to {png}")
    except Exception as e:  # a missing plotting backend must not lose the numbers
        print(f"plot skipped: {e}")


def sweep_command(args: argparse.Namespace) -> int:
    """The grid over one loaded trace: bounds once per pool size, one simulation per cell."""
    _require_trace(args)
    if args.kv_cache_tokens is not None or args.kv_cache_fraction is not None:
        raise ValueError("sweep takes its pool sizes from --fractions, not --kv-cache-tokens / --kv-cache-fraction")
    cost = load_cost_model(args.cost_model)
    base = _base_config(args)
    fractions = _split(args.fractions, float)
    policies = _split(args.policies) if args.policies else [base.schedule_policy]
    evictions = _split(args.evictions) if args.evictions else [base.eviction]
    scales = _split(args.time_scales, float)
    routers = _split(args.routers) if args.routers else [args.router]
    for router in routers:
        if router not in ROUTERS:
            raise ValueError(f"--routers: unknown router {router!r} (known: {', '.join(ROUTERS)})")
    trace = load_trace(args.trace, args.format)
    page = base.tokens_per_page
    by_scale = {scale: scale_trace(trace, _scaling(args, scale), seed=args.trace_seed) for scale in scales}
    first = by_scale[scales[0]]  # time scaling moves arrivals only: one trace's bounds hold for every scale
    unique = unique_prompt_tokens(first)
    accesses = bounds.page_accesses(first, page)
    unbounded = _unbounded(accesses)
    pools = {f: pool_tokens(f, unique, page) for f in fractions}
    shared = shared_tier_options(args, unique)
    extra = shared.capacity_tokens if shared else 0  # the bound of all the KV there is: the store's too
    offline = (
        {} if args.no_bounds else {str(f): _offline(accesses, pools[f] * args.replicas + extra) for f in fractions}
    )
    del accesses
    for cell in [(p, e) for p in policies for e in evictions]:  # fail on a bad name before the long runs
        EngineConfig.from_kwargs(**_cell_kwargs(base, pools[fractions[0]], *cell))
    wanted = router_options(args)  # each router takes the options it has (decode_weight: precise only)
    takers = set().union(*(policy_options(r) for r in routers if r != POOLED))
    if set(wanted) - takers:
        raise ValueError(f"--router-option {', '.join(sorted(set(wanted) - takers))}: no router in --routers takes it")
    runs = []
    cells = [(f, s, p, e, r) for f in fractions for s in scales for p in policies for e in evictions for r in routers]
    for k, (fraction, scale, policy, eviction, router) in enumerate(cells, 1):
        config = EngineConfig.from_kwargs(**_cell_kwargs(base, pools[fraction], policy, eviction))
        desc = f"[{k}/{len(cells)}] {fraction} {policy} {eviction} {router} x{scale}"
        options = {k: v for k, v in wanted.items() if router != POOLED and k in policy_options(router)}
        summary, _ = _run_one(
            config, by_scale[scale], cost, args.quiet, desc, args.replicas, router, options, shared_tier=shared
        )
        summary = _with_bounds(summary, unbounded, offline.get(str(fraction)))
        summary.update(fraction=fraction, pool_tokens=pools[fraction], time_scale=scale, policy=policy)
        summary["eviction"] = eviction
        runs.append(summary)
    described = _scaling(args, scales[0]).describe(trace.block_size)
    results = {
        "command": "simulate sweep",
        "title": f"{os.path.basename(args.trace)}: {described}\n{base.prefix_cache} cache, cost model {cost.name}"
        + (f", {args.replicas} replicas" if args.replicas > 1 else "")
        + (f", shared tier {shared.capacity_tokens} tokens" if shared else ""),
        "trace": {"path": args.trace, "format": trace.format, "block_size": trace.block_size},
        "scaling": {str(s): _scaling(args, s).describe(trace.block_size) for s in scales},
        "unique_prompt_tokens": unique,
        "grid": {
            "fractions": fractions,
            "policies": policies,
            "evictions": evictions,
            "time_scales": scales,
            "routers": routers,
            "replicas": args.replicas,
        },
        "shared_tier": dataclasses.asdict(shared) if shared else None,
        "engine_config": dataclasses.asdict(base),
        "cost_model": cost.to_json(),
        "options": _options(args),
        "bounds": {"unbounded_hit_rate": unbounded["hit_rate"], "unbounded": unbounded, "offline": offline},
        "runs": runs,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(_sweep_table(runs))
    _write_results(results, args.output_dir, "sweep.json")
    png = os.path.join(args.output_dir, "sweep.png")
    if not args.no_plot:
        _try_plot(lambda: report.plot_sweep(results, png), png)
        if len(routers) > 1:
            by_router = os.path.join(args.output_dir, "routers.png")
            _try_plot(lambda: report.plot_routers(results, by_router), by_router)
    return 0


def _cell_kwargs(base: EngineConfig, pool: int, policy: str, eviction: str) -> dict:
    return dataclasses.asdict(base) | {"kv_cache_tokens": pool, "schedule_policy": policy, "eviction": eviction}


def _sweep_table(runs: list[dict]) -> str:
    headers = ["pool", "tokens", "x time", "policy", "eviction", "router", "hit rate", "offline", "/bound", "unbounded"]
    headers += ["TTFT p50", "TTFT p90", "TTFT p99", "queue p99", "out tok/s", "evicted", "preempt", "rejected"]
    headers += ["busy max/mean", "wall s"]
    rows = [
        [
            r["fraction"],
            r["pool_tokens"],
            r["time_scale"],
            r["policy"],
            r["eviction"],
            r["router"],
            r["token_hit_rate"],
            r.get("offline_bound_hit_rate", float("nan")),
            r.get("of_offline_bound") or float("nan"),
            r["unbounded_hit_rate"],
            r["ttft_s"]["p50"],
            r["ttft_s"]["p90"],
            r["ttft_s"]["p99"],
            r["queue_s"]["p99"],
            r["output_tok_s"],
            r["evicted_pages"],
            r["preemptions"],
            r["rejected_requests"],
            r.get("busy_max_over_mean") or float("nan"),
            r["wall_s"],
        ]
        for r in runs
    ]
    return report.format_table(headers, rows)
