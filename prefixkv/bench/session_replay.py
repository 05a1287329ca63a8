"""`prefixkv bench serve --trace DIR`: agent sessions replayed closed loop against a real server, beside the
simulator's prediction of the same slice.

Each session is a task: it waits its think time after each answer, sends the request (a token-id prompt to
/v1/completions, streamed, the output length fixed by ignore_eos), and starts its subagents concurrently at their
recorded offsets, resuming after the last of them, exactly as sim/sessions.py schedules them. The job completion
time (first request due -> last answer) of each session is printed beside the simulator's for the same sessions,
start times, scaling and cost model, with a pool of --sim-kv-cache-tokens (the server's pool).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

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
from prefixkv.sim.cost_model import load_cost_model
from prefixkv.sim.session_command import start_times
from prefixkv.sim.sessions import SessionPolicy, replay_sessions, step_hint
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
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=args.timeout) as client:
        settings = await settings_for(client)
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
    }
    if args.sim_kv_cache_tokens:
        config = EngineConfig(kv_cache_tokens=args.sim_kv_cache_tokens, prefix_caching_hash_algo="xxhash")
        cost = load_cost_model(args.sim_cost_model)
        policy = SessionPolicy("lru" if args.no_session_hints else args.sim_session_policy)
        sim = replay_sessions(config, cost, scaling, mapping, policy, drawn, starts)
        predicted = [run.end_s - run.start_s for run in sim.sessions if run.end_s is not None]
        out["simulated"] = {
            "cost_model": cost.name,
            "session_policy": policy.name,
            "kv_cache_tokens": args.sim_kv_cache_tokens,
            "jct_s": predicted,
            "hit_rate": sim.summary["token_hit_rate"],
            "measured_over_simulated": [m / p if p else None for m, p in zip(measured, predicted, strict=True)],
        }
    return out


def print_summary(out: dict) -> None:
    print(f"{len(out['sessions'])} sessions of {out['trace']} ({out['scaling']}), closed loop")
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
        "--no-session-hints", action="store_true", help="agent traces: send no x-session-* headers (plain LRU)"
    )
