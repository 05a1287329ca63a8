"""`prefixkv bench serve --trace DIR`: agent sessions replayed closed loop against a real server, beside the
simulator's prediction of the same slice.

Each session is a task: it waits its think time after each answer, sends the request (a token-id prompt to
/v1/completions, streamed, the output length fixed by ignore_eos), and starts its subagents concurrently at their
recorded offsets, resuming after the last of them, exactly as sim/sessions.py schedules them. The job completion
time (first request due -> last answer) of each session is printed beside the simulator's for the same sessions,
start times, scaling and cost model, with a pool of --sim-kv-cache-tokens (the server's pool). The simulator charges
the cost model's serving overhead (StepCostModel.served(): its serve_* coefficients, fitted by `prefixkv simulate
fit --serve-url`), since these requests are served; with any, the engine-only prediction is printed too.

Before the clock starts the server is warmed up (--no-warm-up: not): fresh prompts as many tokens as the pool
holds, then its prefix cache emptied. A fresh server's first passes over the pool pay for faulting in its memory
(model/pool_memory.py: mapped page by page on first touch), which the simulator, like a server that has run a
while, does not pay. Then the cost model is calibrated (--calibration-rounds 0: not): a few served rounds timed and
simulated, every coefficient scaled by how much slower they ran than predicted, since a VM's speed drifts by more
within the hour than the model's own error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from prefixkv.bench.served_rounds import (
    RoundTimes,
    ServedShape,
    measure_rounds,
    median_round,
    parse_served_shapes,
    simulate_round,
)
from prefixkv.config import EngineConfig
from prefixkv.session_hint import SessionHint
from prefixkv.sim.agent_traces import (
    AgentRequest,
    AgentScaling,
    AgentSession,
    SubagentGroup,
    draw_sessions,
    load_agent_trace,
    scaled_prompt,
    token_mapping,
)
from prefixkv.sim.cost_model import SERVE_COEFFICIENTS, StepCostModel, load_cost_model
from prefixkv.sim.session_command import start_times
from prefixkv.sim.sessions import SessionPolicy, SessionResult, replay_sessions, step_hint
from prefixkv.sim.traces import BlockTokens


@dataclasses.dataclass
class _Live:
    client: httpx.AsyncClient
    settings: Any  # serve_client.Settings
    send: Callable[..., Awaitable[Any]]  # serve_client.stream_completion
    scaling: AgentScaling
    mapping: BlockTokens
    t0: float
    failures: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hints: bool = True  # send each request's session hint (the x-session-* headers)


def hint_headers(hint: SessionHint) -> dict[str, str]:
    """A session hint as the x-session-* headers (server/session_hints.py)."""
    headers = {"x-session-id": hint.id, "x-session-action": hint.action}
    if hint.parent is not None:
        headers["x-session-parent-id"] = hint.parent
    if hint.expected_pause_s is not None:
        headers["x-session-expected-pause-s"] = f"{hint.expected_pause_s:.3f}"
    return headers


async def _run_agent(
    live: _Live, session: AgentSession, start_s: float, hint_id: str, parent_id: str | None, joined: bool = False
) -> float:
    """Run one agent from `start_s` (seconds since t0); returns the time of its last answer."""
    base = start_s
    for index, step in enumerate(session.steps):
        if isinstance(step, AgentRequest):
            due = base + (0.0 if joined else live.scaling.pause(step.think_s))
            joined = False
            await asyncio.sleep(max(0.0, live.t0 + due - time.perf_counter()))
            prompt = scaled_prompt(step, live.scaling, live.mapping)
            headers = hint_headers(step_hint(session, index, hint_id, parent_id, live.scaling)) if live.hints else None
            result = await live.send(
                live.client, live.settings, prompt.prompt_tokens(), live.scaling.output_len(step), headers=headers
            )
            live.requests += 1
            live.failures += not result.ok
            live.prompt_tokens += result.prompt_tokens
            live.cached_tokens += result.cached_tokens
            base = time.perf_counter() - live.t0
            continue
        assert isinstance(step, SubagentGroup)
        ends = await asyncio.gather(
            *(
                _run_agent(live, agent, base + live.scaling.pause(delay), f"{hint_id}/{agent.id}", hint_id)
                for delay, agent in zip(step.delays_s, step.agents, strict=True)
            )
        )
        base = max(ends) + live.scaling.pause(step.resume_s)
        joined = True
    return base


async def replay_live(
    args: argparse.Namespace,
    base_url: str,
    headers: dict,
    settings_for: Callable[[httpx.AsyncClient], Awaitable[Any]],
    send: Callable[..., Awaitable[Any]],
) -> dict:
    """The closed-loop replay against the server (`send`: serve_client.stream_completion, handed in so that this
    module does not import the client that imports it), then the simulator on the same slice."""
    scaling = AgentScaling(args.tokens_per_block or 4, args.output_scale, args.think_scale, args.max_think_s)
    trace = load_agent_trace(args.trace)
    mapping = token_mapping(trace, scaling, seed=args.seed)
    drawn = draw_sessions(trace, args.sessions, args.seed)
    starts = start_times(len(drawn), args.stagger_s, args.seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    warm_up: dict | None = None
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=args.timeout) as client:
        settings = await settings_for(client)
        if not args.no_warm_up:
            warm_up = await warm_up_server(client, settings, send, args.sim_kv_cache_tokens or 0, args.seed)
        calibration: Calibration | None = None
        if args.sim_kv_cache_tokens and args.calibration_rounds:
            calibration = await measure_calibration(client, settings, send, args)
        live = _Live(client, settings, send, scaling, mapping, time.perf_counter(), hints=not args.no_session_hints)
        runs = [
            _run_agent(live, s, start, f"{k}:{s.id}", None)
            for k, (s, start) in enumerate(zip(drawn, starts, strict=True))
        ]
        ends = await asyncio.gather(*runs)
    measured = [end - start for end, start in zip(ends, starts, strict=True)]
    out = {
        "workload": "agent sessions (closed loop)",
        "trace": args.trace,
        "sessions": [s.id for s in drawn],
        "starts_s": starts,
        "scaling": scaling.describe(),
        "requests": live.requests,
        "failed_requests": live.failures,
        "prompt_tokens": live.prompt_tokens,
        "cached_tokens": live.cached_tokens,
        "hit_rate": live.cached_tokens / live.prompt_tokens if live.prompt_tokens else None,
        "jct_s": measured,
        "warm_up": warm_up,
    }
    if args.sim_kv_cache_tokens:
        config = EngineConfig(kv_cache_tokens=args.sim_kv_cache_tokens, prefix_caching_hash_algo="xxhash")
        fitted = load_cost_model(args.sim_cost_model).served()
        cost, calibrated = calibration.apply(config, fitted) if calibration else (fitted, None)
        policy = SessionPolicy("lru" if args.no_session_hints else args.sim_session_policy)
        sim = replay_sessions(config, cost, scaling, mapping, policy, drawn, starts)
        predicted = _jcts(sim)
        out["simulated"] = {
            "cost_model": cost.name,
            "session_policy": policy.name,
            "kv_cache_tokens": args.sim_kv_cache_tokens,
            "jct_s": predicted,
            "hit_rate": sim.summary["token_hit_rate"],
            "measured_over_simulated": _ratios(measured, predicted),
        }
        if calibrated:  # and what the model predicts as fitted, to show what the calibration changed
            uncalibrated = _jcts(replay_sessions(config, fitted, scaling, mapping, policy, drawn, starts))
            out["simulated"]["calibration"] = calibrated
            out["simulated"]["uncalibrated_jct_s"] = uncalibrated
            out["simulated"]["measured_over_uncalibrated"] = _ratios(measured, uncalibrated)
        if cost.has_serve_overhead:  # what the engine's steps alone predict, to show what serving adds
            engine = replay_sessions(config, cost.engine_only(), scaling, mapping, policy, drawn, starts)
            out["simulated"]["serve_overhead"] = {k: getattr(cost, k) for k in SERVE_COEFFICIENTS}
            out["simulated"]["engine_only_jct_s"] = _jcts(engine)
            out["simulated"]["measured_over_engine_only"] = _ratios(measured, _jcts(engine))
    return out


CALIBRATION_SHAPES = "1x1024->32,4x256->16"


@dataclasses.dataclass
class Calibration:
    """Served rounds measured just before the replay, to scale the cost model to the machine's speed now."""

    shapes: list[ServedShape]
    rounds: dict[ServedShape, list[RoundTimes]]
    seconds: float

    def apply(self, config: EngineConfig, cost: StepCostModel) -> tuple[StepCostModel, dict[str, Any]]:
        """`cost` (served) scaled by the median over shapes of measured / simulated round time (each shape's
        median round): the step model's shape kept, its speed taken from now; and the figures (the JSON's)."""
        rows: list[dict[str, Any]] = []
        for shape in self.shapes:
            kept = median_round(self.rounds[shape])
            simulated = simulate_round(config, cost, shape).e2e_s
            rows.append(
                {
                    "label": shape.label,
                    "measured_s": kept.e2e_s,
                    "simulated_s": simulated,
                    "ratio": kept.e2e_s / simulated,
                    "samples_s": [r.e2e_s for r in self.rounds[shape]],
                }
            )
        factor = statistics.median(row["ratio"] for row in rows)
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        why = f"calibrated by the replay's served rounds ({', '.join(r['label'] for r in rows)}), {when}"
        return cost.scaled(factor, why), {"factor": factor, "seconds": self.seconds, "shapes": rows}


async def measure_calibration(
    client: httpx.AsyncClient, settings: Any, send: Callable[..., Awaitable[Any]], args: argparse.Namespace
) -> Calibration:
    """--calibration-rounds rounds of each --calibration-shapes shape (fresh prompts), then the cache emptied.
    Without the warm-up, one round more first (a cold server's first requests pay for lazy initialisation)."""
    if args.calibration_rounds < 0:
        raise ValueError(f"--calibration-rounds must be >= 0, got {args.calibration_rounds}")
    shapes = parse_served_shapes(args.calibration_shapes, "--calibration-shapes")
    started = time.perf_counter()
    rounds = await measure_rounds(
        client, settings, send, shapes, args.calibration_rounds, args.seed, warm_up=args.no_warm_up
    )
    await client.post("/reset_prefix_cache")
    return Calibration(shapes, rounds, time.perf_counter() - started)


WARM_UP_PROMPT_TOKENS = 1024
_WARM_UP_IDS = (100, 49_000)  # BlockTokens' default range: ids every vocabulary the replays run holds


async def warm_up_server(
    client: httpx.AsyncClient, settings: Any, send: Callable[..., Awaitable[Any]], pool_tokens: int, seed: int
) -> dict:
    """Fresh prompts of WARM_UP_PROMPT_TOKENS, one more than fills `pool_tokens` (at least one), each answered
    with one token; then POST /reset_prefix_cache, so that the replay starts from an empty cache. What it took."""
    rng = random.Random(f"warm-up {seed}")
    count = pool_tokens // WARM_UP_PROMPT_TOKENS + 1
    started = time.perf_counter()
    for _ in range(count):
        prompt = [rng.randrange(*_WARM_UP_IDS) for _ in range(WARM_UP_PROMPT_TOKENS)]
        result = await send(client, settings, prompt, 1)
        if not result.ok:
            raise RuntimeError(f"the warm-up request failed: {result.error}")
    reset = await client.post("/reset_prefix_cache")
    return {
        "requests": count,
        "prompt_tokens": count * WARM_UP_PROMPT_TOKENS,
        "seconds": time.perf_counter() - started,
        "cache_reset": reset.status_code == 200,
    }


def _jcts(sim: SessionResult) -> list[float]:
    return [run.end_s - run.start_s for run in sim.sessions if run.end_s is not None]


def _ratios(measured: list[float], predicted: list[float]) -> list[float | None]:
    return [m / p if p else None for m, p in zip(measured, predicted, strict=True)]


def print_summary(out: dict) -> None:
    print(f"{len(out['sessions'])} sessions of {out['trace']} ({out['scaling']}), closed loop")
    warm = out.get("warm_up")
    if warm:
        reset = "its cache emptied" if warm["cache_reset"] else "its cache NOT emptied (/reset_prefix_cache refused)"
        print(f"server warmed up first: {warm['requests']} fresh prompts in {warm['seconds']:.1f} s, {reset}")
    print(
        f"{out['requests']} requests, {out['failed_requests']} failed; hit rate "
        f"{out['hit_rate'] if out['hit_rate'] is None else round(out['hit_rate'], 4)}"
    )
    sim = out.get("simulated")
    for k, sid in enumerate(out["sessions"]):
        line = f"  {sid}: JCT {out['jct_s'][k]:.2f} s"
        if sim:
            line += (
                f", simulated {sim['jct_s'][k]:.2f} s (measured / simulated {sim['measured_over_simulated'][k]:.3f})"
            )
        print(line)
    if sim:
        print(f"simulated hit rate {sim['hit_rate']:.4f} (cost model {sim['cost_model']})")
        if "calibration" in sim:
            c = sim["calibration"]
            rounds = ", ".join(f"{r['label']} x{r['ratio']:.3f}" for r in c["shapes"])
            ratios = " / ".join(f"{r:.3f}" for r in sim["measured_over_uncalibrated"] if r is not None)
            print(
                f"calibration ({c['seconds']:.0f} s): served rounds took x{c['factor']:.3f} the cost model's time "
                f"({rounds}); the prediction above is the model scaled by it; as fitted, measured / simulated: {ratios}"
            )
        if "engine_only_jct_s" in sim:
            overhead = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sim["serve_overhead"].items())
            ratios = " / ".join(f"{r:.3f}" for r in sim["measured_over_engine_only"] if r is not None)
            print(f"serving overhead charged: {overhead}; measured / engine-only simulated: {ratios}")


def add_session_arguments(t: argparse._ArgumentGroup) -> None:
    """The session replay's options (the trace group of `bench serve`)."""
    t.add_argument("--sessions", type=int, default=4, help="agent traces: sessions drawn (seeded by --seed)")
    t.add_argument("--stagger-s", type=float, default=2.0, help="agent traces: sessions start within this many s")
    t.add_argument("--think-scale", type=float, default=1.0, help="agent traces: think times x this")
    t.add_argument("--max-think-s", type=float, default=3600.0, help="agent traces: longer pauses are cut to this")
    t.add_argument(
        "--sim-kv-cache-tokens",
        type=int,
        default=None,
        help="agent traces: also simulate the slice with this pool (the server's) and print the predicted JCTs",
    )
    t.add_argument("--sim-cost-model", default="smollm2-cpu-2t", help="agent traces: the simulator's cost model")
    t.add_argument(
        "--sim-session-policy",
        default="session",
        choices=("ttl", "pause", "session"),
        help="agent traces: the server's --session-policy, for the simulation (default: the server's default)",
    )
    t.add_argument(
        "--calibration-rounds",
        type=int,
        default=3,
        help="agent traces, with --sim-kv-cache-tokens: before the replay, time this many served rounds of each "
        "--calibration-shapes shape and scale the simulator's cost model by how much slower (or faster) they ran "
        "than it predicts: the machine's speed now, not the fit's (0: the model as fitted)",
    )
    t.add_argument(
        "--calibration-shapes",
        default=CALIBRATION_SHAPES,
        help="agent traces: the calibration rounds, CONCURRENCYxPROMPT->OUTPUT, comma-separated (fresh prompts)",
    )
    t.add_argument(
        "--no-session-hints", action="store_true", help="agent traces: send no x-session-* headers (plain LRU)"
    )
    t.add_argument(
        "--no-warm-up",
        action="store_true",
        help="agent traces: start at once, on a cold server (default: first fill its pool once with fresh prompts "
        "and empty its cache)",
    )
