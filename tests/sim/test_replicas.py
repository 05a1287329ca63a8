"""Several replicas behind the router library on one simulated clock: tenants whose system prompts do not all fit
one replica's pool (a tiny workload: milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prefixkv.config import EngineConfig
from prefixkv.sim.cost_model import PRESETS
from prefixkv.sim.replicas import ROUTERS, simulate_replicas, summarize_replicas

PAGE = 4
SYSTEM = 32  # tokens of each tenant's system prompt: 8 pages


@dataclass
class Req:
    arrival_s: float
    tokens: list[int]
    output_len: int = 2

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def prompt_tokens(self) -> list[int]:
        return list(self.tokens)


def three_tenants(n: int = 36) -> list[Req]:
    """Tenants 0, 1, 2 in turn, one request a second (no queueing), each its system prompt + a unique question."""
    return [
        Req(float(k), [1000 * (k % 3) + i for i in range(SYSTEM)] + [50_000 + 4 * k + i for i in range(4)])
        for k in range(n)
    ]


def run(router: str):
    # a replica's pool holds two system prompts and a request, not three: round-robin sends every tenant to both
    # replicas and LRU thrashes; a cache-aware router keeps each tenant on one replica
    config = EngineConfig(
        prefix_cache="radix", page_size=PAGE, kv_cache_tokens=80, max_num_seqs=4, max_num_batched_tokens=256
    )
    fleet = simulate_replicas(config, three_tenants(), PRESETS["smollm2-cpu-2t"], 2, router)
    return fleet, summarize_replicas(fleet)


def test_cache_aware_routers_keep_tenants_apart_and_the_index_mirrors_each_cache():
    rates = {}
    for router in ROUTERS:
        fleet, summary = run(router)
        assert summary["served_requests"] == 36 and summary["rejected_requests"] == 0
        assert all(kv.num_used_pages() == 0 for kv in fleet.kvs)  # no page leaks once every request is done
        rates[router] = summary["token_hit_rate"]
        if router == "precise":
            index = fleet.router.policy.index  # type: ignore[attr-defined]
            for i, kv in enumerate(fleet.kvs):
                assert index.blocks(f"replica-{i}") == kv.cached_block_hashes()
            assert fleet.router.policy.num_in_flight_blocks == 0  # type: ignore[attr-defined]
    assert rates["round-robin"] < 0.3 < rates["approximate"]
    assert rates["precise"] >= rates["approximate"]
    assert rates["pooled"] >= rates["precise"] - 0.05


def test_a_bad_router_or_replica_count_is_a_clear_error():
    config = EngineConfig(page_size=PAGE, kv_cache_tokens=96)
    with pytest.raises(ValueError, match="unknown router 'random'"):
        simulate_replicas(config, three_tenants(3), PRESETS["smollm2-cpu-2t"], 2, "random")
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        simulate_replicas(config, three_tenants(3), PRESETS["smollm2-cpu-2t"], 0, "precise")
