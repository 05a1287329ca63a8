"""`prefixkv simulate sessions`: coding-agent sessions replayed closed loop, one run per pool size x policy.

N sessions are drawn (seeded) from a kv-cache-tester trace directory and start within --stagger-s of each other;
each run reports the hit rate beside the offline bound on the order it served, and the job completion time (JCT:
a session's first request to its last answer, subagents included) beside each session's solo run. Writes
sessions.json and sessions.png. See docs/agent_traces.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time

from prefixkv.config import EngineConfig
from prefixkv.engine_args import add_engine_args
from prefixkv.sim import bounds, report
from prefixkv.sim.agent_traces import (
    AgentScaling,
    AgentSession,
    describe,
    draw_sessions,
    is_agent_trace,
    load_agent_trace,
    token_mapping,
)
from prefixkv.sim.command import (
    _MODEL_ONLY,
    _NO_HINTS,
    _NOT_SIMULATED,
    _TIER_HONOURED,
    _split,
    _try_plot,
    _write_results,
    add_tier_arguments,
    check_tier_flags,
    refuse_unsimulated,
    sim_engine_kwargs,
    tier_options,
)
from prefixkv.sim.cost_model import PRESETS, load_cost_model
from prefixkv.sim.sessions import (
    POLICIES,
    TIER_ACTIONS,
    SessionPolicy,
    add_common_jct,
    common_sessions,
    mean_jct,
    replay_sessions,
)
from prefixkv.stats import ratio


def register_sessions(simulate_sub) -> None:
    p = simulate_sub.add_parser(
        "sessions",
        help="agent sessions (Claude Code traces) replayed closed loop under session-aware cache policies",
        description=__doc__,
        allow_abbrev=False,
    )
    t = p.add_argument_group("sessions")
    t.add_argument("--trace", required=True, help="a directory of kv-cache-tester session files (or one .json)")
    t.add_argument("--sessions", type=int, default=16, help="concurrent sessions drawn from the set (default 16)")
    t.add_argument("--session-seed", type=int, default=0, help="seed of the draw and of the start times")
    t.add_argument("--stagger-s", type=float, default=60.0, help="sessions start uniformly within this many seconds")
    t.add_argument("--tokens-per-block", type=int, default=4, help="tokens per 64-token block (default 4: 115K -> 7K)")
    t.add_argument("--output-scale", type=float, default=None, help="output lengths x this (default: as prompts)")
    t.add_argument("--think-scale", type=float, default=1.0, help="think times x this (default 1: as recorded)")
    t.add_argument(
        "--max-think-s",
        type=float,
        default=3600.0,
        help="cut longer pauses to this (default 3600: a session left for days is a new day, not a tool call)",
    )
    t.add_argument("--trace-seed", type=int, default=0, help="seed of the hash id -> token ids mapping")
    t.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"session policies ({', '.join(POLICIES)}), each with tier actions after '+' "
        f"({', '.join(TIER_ACTIONS)}; e.g. session+prefetch)",
    )
    t.add_argument("--pin-seconds", type=float, default=300.0, help="ttl policy: the fixed pin (default 300 s)")
    t.add_argument("--grace", type=float, default=1.25, help="pause policy: the pin lasts the pause x this + 1 s")
    t.add_argument(
        "--fractions", default="0.25", help="pool sizes as fractions of the working set (the sessions' peak contexts)"
    )
    k = p.add_argument_group("second KV tier (simulated: sim/tier.py)")
    k.add_argument(
        "--tier-fractions",
        default="0",
        help="second-tier sizes as fractions of the working set, each run beside the pool (default 0: no tier); "
        "policies with tier actions (+demote, +prefetch) run only with a tier",
    )
    add_tier_arguments(k)
    add_engine_args(
        p,
        exclude=_MODEL_ONLY + _NOT_SIMULATED + _NO_HINTS + ("kv_cache_tokens",),
        aliases={"prefix_cache": ("--cache",)},
    )
    refuse_unsimulated(p, _TIER_HONOURED)
    s = p.add_argument_group("output")
    s.add_argument("--cost-model", default="smollm2-cpu-2t", help=f"a preset ({', '.join(PRESETS)}) or a fit's JSON")
    s.add_argument("--no-solo", action="store_true", help="skip each session's solo run (no slowdowns)")
    s.add_argument("--no-bounds", action="store_true", help="skip the offline bound")
    s.add_argument("--output-dir", default="sim_results", help="where sessions.json and sessions.png go")
    s.add_argument("--no-plot", action="store_true", help="write the JSON only")
    # pins need room: most of the pool may be retained (the engine's default cap, 0.2, is for per-request retention)
    p.set_defaults(func=sessions_command, prefix_caching_hash_algo="xxhash", retained_pool_fraction=0.9)


def working_set(sessions: list[AgentSession], scaling: AgentScaling) -> int:
    """What the sessions hold at their peaks, all at once: the sum of each session's largest scaled prompt."""
    return sum(max(scaling.prompt_len(r) for r in s.requests()) for s in sessions)


def start_times(count: int, stagger_s: float, seed: int) -> list[float]:
    if stagger_s < 0:
        raise ValueError(f"--stagger-s must be >= 0, got {stagger_s}")
    rng = random.Random(seed + 1)
    return sorted(rng.uniform(0, stagger_s) for _ in range(count))


def sessions_command(args: argparse.Namespace) -> int:
    if not is_agent_trace(args.trace):
        raise ValueError(f"--trace {args.trace}: expected a directory of session .json files or one .json file")
    cost = load_cost_model(args.cost_model)
    policies = [SessionPolicy(name, args.pin_seconds, args.grace) for name in _split(args.policies)]
    fractions = _split(args.fractions, float)
    tier_fractions = _split(args.tier_fractions, float)
    if any(not f >= 0 for f in tier_fractions):
        raise ValueError(f"--tier-fractions must be >= 0, got {args.tier_fractions}")
    if not any(tier_fractions) and any(p.acts_on_tier for p in policies):
        raise ValueError("a policy with tier actions (+demote, +prefetch) needs --tier-fractions above 0")
    check_tier_flags(args, any(tier_fractions), "--tier-fractions above 0")
    scaling = AgentScaling(args.tokens_per_block, args.output_scale, args.think_scale, args.max_think_s)
    trace = load_agent_trace(args.trace)
    mapping = token_mapping(trace, scaling, seed=args.trace_seed)
    drawn = draw_sessions(trace, args.sessions, args.session_seed)
    starts = start_times(len(drawn), args.stagger_s, args.session_seed)
    base = EngineConfig.from_kwargs(**(sim_engine_kwargs(args) | {"kv_cache_tokens": None}))
    page = base.tokens_per_page
    need = working_set(drawn, scaling)
    print(f"trace {args.trace}: {len(trace.sessions)} sessions; {len(drawn)} drawn (seed {args.session_seed})")
    print(f"{scaling.describe()}; working set {need} tokens; cost model {cost.name}", flush=True)
    solo: dict[str, float] = {}
    runs = []
    for fraction in fractions:
        pool = max(1, round(fraction * need / page)) * page
        config = dataclasses.replace(base, kv_cache_tokens=pool)
        if not args.no_solo:
            solo = _solo_jcts(config, cost, scaling, mapping, drawn)
        for tier_fraction, policy in [(tf, p) for tf in tier_fractions for p in policies if tf or not p.acts_on_tier]:
            tier = tier_options(args, tier_fraction, need, cost) if tier_fraction else None
            t0 = time.perf_counter()
            result = replay_sessions(config, cost, scaling, mapping, policy, drawn, starts, tier=tier)
            summary = result.summary
            label = policy.name + (f" tier {tier_fraction:g}" if tier else "")
            summary.update(fraction=fraction, pool_tokens=pool, label=label, wall_s=time.perf_counter() - t0)
            summary.update(tier_fraction=tier_fraction, tier_tokens=tier.capacity_tokens if tier else 0)
            if not args.no_bounds:
                acc = bounds.page_accesses(result.served, page)
                summary["unbounded_hit_rate"] = bounds.unbounded_hit_tokens(acc, page).rate
                capacity = (pool + summary["tier_tokens"]) // page  # the pool and the tier as one pool: a bound on both
                summary["offline_bound_hit_rate"] = bounds.offline_hit_tokens(acc, page, capacity).rate
                summary["of_offline_bound"] = ratio(summary["token_hit_rate"], summary["offline_bound_hit_rate"])
            if solo:
                slow = [jct / solo[sid.split(":", 1)[1]] for sid, jct in summary["jct_by_session"].items()]
                summary["slowdown_vs_solo"] = {"mean": sum(slow) / len(slow), "max": max(slow)}
            runs.append(summary)
            print(
                f"  pool {fraction:g} ({pool} tokens) {label}: hit {summary['token_hit_rate']:.3f}, mean JCT "
                f"{summary['jct_s']['mean']:.0f} s, {summary['rejected_requests']} rejected "
                f"({summary['wall_s']:.1f} s wall)",
                flush=True,
            )
    common = add_common_jct(runs)
    targets_rows = targets(runs)
    results = {
        "command": "simulate sessions",
        "trace": {"path": args.trace, "sessions": len(trace.sessions), "facts": describe(trace)},
        "drawn": [s.id for s in drawn],
        "starts_s": starts,
        "scaling": scaling.describe(),
        "working_set_tokens": need,
        "engine_config": dataclasses.asdict(base),
        "cost_model": cost.to_json(),
        "tier_cost": tier_options(args, 1.0, need, cost).cost.to_json() if any(tier_fractions) else None,
        "solo_jct_s": solo,
        "common_sessions": common,  # served whole by every run: the JCTs that compare across runs
        "runs": runs,
        "targets": targets_rows,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(_table(runs))
    if not all(r["comparable"] for r in runs):
        print(
            f"* rejected requests: that run's sessions went on without them, so its JCTs are not comparable; the "
            f"common column is over the {len(common)} of {len(drawn)} sessions whose requests every run served alike"
        )
    print(_targets_table(targets_rows))
    _write_results(results, args.output_dir, "sessions.json")
    png = os.path.join(args.output_dir, "sessions.png")
    if not args.no_plot:
        _try_plot(lambda: report.plot_sessions(results, png), png)
    return 0


def _solo_jcts(config, cost, scaling, mapping, drawn: list[AgentSession]) -> dict[str, float]:
    """Each distinct session alone on the engine (LRU, the same pool): the JCT it would have with no company."""
    out: dict[str, float] = {}
    for session in drawn:
        if session.id not in out:
            res = replay_sessions(config, cost, scaling, mapping, SessionPolicy("lru"), [session], [0.0])
            out[session.id] = res.sessions[0].end_s or 0.0
    return out


def targets(runs: list[dict]) -> list[dict]:
    """Per pool size: the best policy by mean JCT against LRU and the fixed TTL, its share of the offline bound and
    its worst slowdown; with a pool of at least the whole working set in the grid, also the most any cache policy
    could gain there: LRU's mean JCT over LRU's with that pool (no capacity misses at all). Each comparison is
    over the sessions its runs served alike (common_sessions), so a run that rejected requests does not look
    faster."""
    largest = max(
        (r for r in runs if _label(r) == "lru" and r["fraction"] >= 1), key=lambda r: r["fraction"], default=None
    )
    out = []
    for fraction in sorted({r["fraction"] for r in runs}):
        cell = {_label(r): r for r in runs if r["fraction"] == fraction}
        alike = common_sessions(list(cell.values()))
        best = min(cell.values(), key=lambda r: mean_jct(r, alike))
        row = {"fraction": fraction, "best_policy": _label(best), "of_offline_bound": best.get("of_offline_bound")}
        row["compared_sessions"] = len(alike)
        for other in ("lru", "ttl"):
            if other in cell:
                row[f"jct_{other}_over_best"] = ratio(mean_jct(cell[other], alike), mean_jct(best, alike))
        row["max_slowdown_vs_solo"] = best.get("slowdown_vs_solo", {}).get("max")
        if largest is not None and "lru" in cell:
            pair = common_sessions([cell["lru"], largest])
            row["jct_lru_over_unlimited_pool"] = ratio(mean_jct(cell["lru"], pair), mean_jct(largest, pair))
            row["unlimited_pool_compared_sessions"] = len(pair)
        out.append(row)
    return out


def _common_mean(run: dict) -> float:
    """The run's mean JCT over the common sessions (runs written before them: over all)."""
    return run.get("jct_common_s", run["jct_s"])["mean"]


def _label(run: dict) -> str:
    """The policy, and the tier it ran with (runs written before the tier have no label)."""
    return run.get("label", run["policy"])


def _targets_table(rows: list[dict]) -> str:
    headers = ["pool", "sessions compared", "best", "/bound", "LRU JCT / best", "TTL JCT / best", "max slowdown"]
    headers += ["LRU JCT / unlimited pool (sessions)"]
    nan = float("nan")
    cells = [
        [
            t["fraction"],
            t.get("compared_sessions", "all"),
            t["best_policy"],
            t["of_offline_bound"] or nan,
            t.get("jct_lru_over_best", nan),
            t.get("jct_ttl_over_best", nan),
            t["max_slowdown_vs_solo"] or nan,
            f"{t['jct_lru_over_unlimited_pool']:.4f} ({t['unlimited_pool_compared_sessions']})"
            if "jct_lru_over_unlimited_pool" in t
            else nan,
        ]
        for t in rows
    ]
    return report.format_table(headers, cells)


def _table(runs: list[dict]) -> str:
    headers = ["pool", "policy", "hit rate", "offline", "/bound", "JCT mean s", "JCT p90 s", "common JCT mean s"]
    headers += ["slowdown mean", "max", "tier hit", "evicted", "rejected", "wall s"]
    rows = []
    for r in runs:
        slow = r.get("slowdown_vs_solo", {})
        rows.append(
            [
                r["fraction"],
                _label(r) + ("" if r.get("comparable", True) else " *"),
                r["token_hit_rate"],
                r.get("offline_bound_hit_rate", float("nan")),
                r.get("of_offline_bound") or float("nan"),
                r["jct_s"]["mean"],
                r["jct_s"]["p90"],
                _common_mean(r),
                slow.get("mean", float("nan")),
                slow.get("max", float("nan")),
                ratio(r.get("tier_hit_tokens", 0), r["prompt_tokens"]),
                r["evicted_pages"],
                r["rejected_requests"],
                r["wall_s"],
            ]
        )
    return report.format_table(headers, rows)
