"""Whether a miss cause names what happened: run the world without its mechanism and count the tokens won back.

`prefixkv simulate --check-causes`: after the run, each cause the run blamed tokens on and that the simulator can
take away is taken away in a run of its own, the rest unchanged:
- evicted: a pool as large as everything the trace writes (no page is ever dropped, so a lapsed retention's
  eviction goes too: the row counts `evicted` and `expired` together);
- expired: the same retention with no end (--retention-seconds made endless, the retention cap kept);
- isolated: one tenant (every request under the same salt);
- routed: the pooled router (one engine with every replica's pool: no prefix is on the wrong replica).
`never_seen` (compulsory), `granularity` (the engine's rule) and `in_flight` have no such world, and `unknown`
never occurs here (the simulator keeps every eviction).

Each row gives the tokens blamed and how many of them the run without the mechanism wins back: per request, its
extra hit tokens there, up to what that request blamed on the cause. That share is the evidence that the cause
names what happened: near 1, the tokens blamed on the mechanism come back without it; near 0, something else
(another limit) would have cost them anyway. Beside it, the net change of all hits, which also counts what the
removal costs other requests (an endless retention takes room from pages that are not retained): a removal can
win back every token blamed and still lose hits overall. That the causes sum to the missed tokens is true by
construction, whatever they mean: a regression guard, not evidence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from prefixkv.config import EngineConfig
from prefixkv.sim.replicas import POOLED
from prefixkv.sim.simulator import RequestMetrics, Tenancy
from prefixkv.sim.traces import ScaledRequest

NO_END_S = 1e15  # simulated seconds: a retention that outlives any trace


class World(NamedTuple):
    """What one run is given: the engine, the tenancy, the router (None: one engine)."""

    config: EngineConfig
    tenancy: Tenancy
    router: str | None = None


class Removal(NamedTuple):
    world: World
    removes: tuple[str, ...]  # the causes it takes away
    without: str  # the world without it, in words


Runner = Callable[[World], tuple[dict, Sequence[RequestMetrics]]]  # one run -> its summary and requests


def removals(world: World, requests: Sequence[ScaledRequest], unique_tokens: int) -> dict[str, Removal]:
    """Per removable cause, the world without its mechanism."""
    config, tenancy = world.config, world.tenancy
    page = config.tokens_per_page
    written = unique_tokens + sum(r.output_len for r in requests) + page * len(requests)  # pages never shared
    pool = max(-(-written // page) * page, config.kv_cache_tokens or 0)
    out = {
        "evicted": Removal(
            world._replace(config=dataclasses.replace(config, kv_cache_tokens=pool)),
            ("evicted", "expired"),
            "a pool holding everything written",
        )
    }
    if tenancy.retention_seconds:
        endless = dataclasses.replace(tenancy, retention_seconds=NO_END_S)
        out["expired"] = Removal(world._replace(tenancy=endless), ("expired",), "the retention without end, cap kept")
    if tenancy.tenants > 1:
        one = dataclasses.replace(tenancy, tenants=1)
        out["isolated"] = Removal(world._replace(tenancy=one), ("isolated",), "one tenant")
    if world.router is not None and world.router != POOLED:
        out["routed"] = Removal(world._replace(router=POOLED), ("routed",), "pooled routing")
    return out


def check_causes(
    summary: dict,
    metrics: Sequence[RequestMetrics],
    world: World,
    requests: Sequence[ScaledRequest],
    unique_tokens: int,
    run: Runner,
) -> list[dict]:
    """One row per cause the run (`summary`, its requests' `metrics`) blamed tokens on and the simulator can
    remove: the tokens blamed, those the run without the mechanism wins back and their share, and the net change
    of all hits."""
    prompt, hits = summary["prompt_tokens"], summary["hit_tokens"]
    rows = []
    for cause, removal in removals(world, requests, unique_tokens).items():
        blamed = sum(summary["missed_tokens_by_cause"].get(c, 0) for c in removal.removes)
        if not blamed or not prompt:
            continue
        other, other_metrics = run(removal.world)
        won_back = won_back_tokens(metrics, other_metrics, removal.removes)
        net = other["hit_tokens"] - hits
        rows.append(
            {
                "cause": cause,
                "removes": list(removal.removes),
                "without": removal.without,
                "blamed_tokens": blamed,
                "won_back_tokens": won_back,
                "recovered_share": won_back / blamed,
                "net_hit_tokens": net,  # every request's, what the removal cost others included
                "net_share": net / blamed,
                # the net is over the same prompts only when both runs served the same requests (a larger pool
                # may serve requests the run rejected)
                "same_requests": other["prompt_tokens"] == prompt,
                "hit_rate": summary["token_hit_rate"],
                "hit_rate_without": other["token_hit_rate"],
            }
        )
    return rows


def won_back_tokens(metrics: Sequence[RequestMetrics], without: Sequence[RequestMetrics], causes: Sequence[str]) -> int:
    """Of the tokens each request blamed on `causes`, how many the other run hit: per request, its extra hit
    tokens there, up to its blamed tokens (a request's gain beyond them is another cause's, or a second-order
    effect's)."""
    hits_without = {m.request_id: m.hit_tokens for m in without}
    total = 0
    for m in metrics:
        blamed = sum(m.missed_by_cause.get(c, 0) for c in causes)
        if blamed:
            gain = hits_without.get(m.request_id, 0) - m.hit_tokens
            total += min(max(gain, 0), blamed)
    return total
