"""Whether the miss causes mean what they say: remove one cause from the simulated world and see the hits come back.

`prefixkv simulate --check-causes`: after the run, each cause the run attributed tokens to and that the
simulator can take away is taken away in a run of its own, the rest unchanged:
- evicted: a pool as large as everything the trace writes (no page is ever dropped);
- expired: the same retention with no end (--retention-seconds made infinite: nothing lapses);
- isolated: one tenant (every request under the same salt).
The first run's breakdown predicts that run's hit rate: its hits plus the tokens it blamed on that cause. The
report gives predicted, achieved and the gap in points. Second-order effects are real (more hits make the
simulated clock run faster, so fewer requests overlap in flight), so the gap is small rather than zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from prefixkv.config import EngineConfig
from prefixkv.sim.simulator import Tenancy
from prefixkv.sim.traces import ScaledRequest

NO_END_S = 1e15  # simulated seconds: a retention that outlives any trace
# what each removal takes away: no pool limit means no eviction at all, a lapsed retention's included
REMOVES = {"evicted": ("evicted", "expired"), "expired": ("expired",), "isolated": ("isolated",)}
Runner = Callable[[EngineConfig, Tenancy], dict]  # one run -> its summary


def removals(
    config: EngineConfig, tenancy: Tenancy, requests: Sequence[ScaledRequest], unique_tokens: int
) -> dict[str, tuple[EngineConfig, Tenancy]]:
    """Per removable cause, the world without it."""
    page = config.tokens_per_page
    written = unique_tokens + sum(r.output_len for r in requests) + page * len(requests)  # pages never shared
    pool = max(-(-written // page) * page, config.kv_cache_tokens or 0)
    out = {"evicted": (dataclasses.replace(config, kv_cache_tokens=pool), tenancy)}
    if tenancy.retention_seconds:
        out["expired"] = (config, dataclasses.replace(tenancy, retention_seconds=NO_END_S))
    if tenancy.tenants > 1:
        out["isolated"] = (config, dataclasses.replace(tenancy, tenants=1))
    return out


def check_causes(
    summary: dict,
    config: EngineConfig,
    tenancy: Tenancy,
    requests: Sequence[ScaledRequest],
    unique_tokens: int,
    run: Runner,
) -> list[dict]:
    """One row per cause the run blamed tokens on and the simulator can remove: predicted and achieved hit rates."""
    prompt, hits = summary["prompt_tokens"], summary["hit_tokens"]
    rows = []
    for cause, (cfg, ten) in removals(config, tenancy, requests, unique_tokens).items():
        blamed = sum(summary["missed_tokens_by_cause"].get(c, 0) for c in REMOVES[cause])
        if not blamed or not prompt:
            continue
        achieved = run(cfg, ten)["token_hit_rate"]
        predicted = (hits + blamed) / prompt
        rows.append(
            {
                "cause": cause,
                "blamed_tokens": blamed,
                "predicted_hit_rate": predicted,
                "achieved_hit_rate": achieved,
                "gap_points": 100 * (achieved - predicted),
            }
        )
    return rows
