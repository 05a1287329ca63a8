"""The shared KV tier in the simulator: one store behind every replica's pool (what one replica wrote, another
loads), its events for the router, and the precise router spreading a hot prefix once the store holds it (tiny
workloads: milliseconds)."""

from __future__ import annotations

import json

import pytest

from prefixkv.cli import main
from prefixkv.config import EngineConfig
from prefixkv.kvcache.events import BlockStored
from prefixkv.kvcache.hashing import external_block_hash
from prefixkv.sim.cost_model import PRESETS
from prefixkv.sim.replicas import simulate_replicas, summarize_replicas
from prefixkv.sim.shared_tier import SharedStore, default_shared_tier_cost, remote_block_weight
from prefixkv.sim.tier import SimTier, SimTierOptions, TierCost, load_tier_cost
from tests.sim.test_replicas import Req
from tests.sim.test_sim_tier import Clock

PAGE = 4
CPU = PRESETS["smollm2-cpu-2t"]
# one simulated byte a token: a 4-token chunk writes in 1 s and reads in 0.5 s; each question asked costs 0.25 s
SLOW_STORE = TierCost("slow-store", "test", "remote", 1, read_bytes_per_s=8.0, write_bytes_per_s=4.0, op_latency_s=0.25)


def test_two_replicas_share_one_store_each_on_its_own_clock_and_channels():
    store = SharedStore(capacity_tokens=12, chunk_tokens=PAGE, publish=True)
    clock_a, clock_b = Clock(), Clock()
    a = SimTier(12, PAGE, "xxhash", SLOW_STORE, clock_a, store=store)
    b = SimTier(12, PAGE, "xxhash", SLOW_STORE, clock_b, store=store)
    chunk = bytes(PAGE)
    a.put(b"x", chunk)  # readable at 1 s, for both
    clock_b.t = 0.5
    assert not b.contains(b"x") and b.get(b"x") is None
    clock_b.t = 1.5
    assert b.contains(b"x") and b.get(b"x") == chunk
    assert b.take_stall() == pytest.approx(2 * 0.25 + 0.5)  # two round trips, then the read
    assert a.take_stall() == 0.0  # b's questions are not a's
    b.put(b"x", chunk)  # already stored (by a): not written again
    assert (a.stats.entries, b.stats.entries, store.stats.entries) == (1, 0, 1)
    assert [type(e).__name__ for e in store.drain_events(0.9)] == []  # a's write is not done yet at 0.9 s
    (event,) = store.drain_events(1.0)
    assert isinstance(event, BlockStored) and event.medium == "REMOTE" and event.block_size == PAGE
    assert event.block_hashes == [external_block_hash(b"x")]
    clock_a.t = 2.0
    a.put(b"y", chunk)  # done at 3 s
    a.put(b"z", chunk)  # done at 4 s
    clock_a.t = clock_b.t = 4.5
    assert b.get(b"x") == chunk  # b's read makes x the most recently used of the three
    a.put(b"w", chunk)  # 4 chunks for 3: the least recently used, y, goes
    assert store.stats.evicted == 1 and not store.held(b"y") and store.held(b"x")
    events = store.drain_events(10.0)  # y's write was done before its eviction, but heard of only after it
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert [e.block_hashes for e in events] == [[external_block_hash(k)] for k in (b"z", b"y", b"w")]
    assert all(e.medium == "REMOTE" for e in events)


def test_a_write_evicted_before_it_is_done_announces_nothing():
    store = SharedStore(capacity_tokens=PAGE, chunk_tokens=PAGE, publish=True)
    tier = SimTier(PAGE, PAGE, "xxhash", SLOW_STORE, Clock(), store=store)
    tier.put(b"x", bytes(PAGE))  # done at 1 s
    tier.put(b"y", bytes(PAGE))  # queued behind it (done at 2 s); evicts x at once
    events = store.drain_events(5.0)
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockStored"]
    assert events[1].block_hashes == [external_block_hash(b"y")]


def config(pool_tokens: int = 256) -> EngineConfig:
    return EngineConfig(
        prefix_cache="radix", page_size=PAGE, kv_cache_tokens=pool_tokens, max_num_seqs=8, max_num_batched_tokens=512
    )


FAST_STORE = TierCost("fast-store", "test", "remote", 1, read_bytes_per_s=4e4, write_bytes_per_s=4e4, op_latency_s=1e-5)


def shared(capacity_tokens: int = 4096) -> SimTierOptions:
    return SimTierOptions(capacity_tokens, FAST_STORE, chunk_tokens=PAGE)


def test_a_chunk_one_replica_stored_is_a_hit_on_the_other():
    system = list(range(32))  # 8 chunks
    requests = [Req(0.0, system + [900, 901, 902]), Req(5.0, system + [950, 951, 952])]  # round-robin: 0, then 1
    without = simulate_replicas(config(), requests, CPU, 2, "round-robin")
    assert [r.metrics[0].hit_tokens for r in without.results] == [0, 0]
    fleet = simulate_replicas(config(), requests, CPU, 2, "round-robin", shared_tier=shared())
    assert fleet.routed == [1, 1]
    assert [r.metrics[0].hit_tokens for r in fleet.results] == [0, 32]
    first, second = (c.cache.tier_stats for c in fleet.copiers)
    # replica 0 computed and stored the prefix's 8 chunks, and a 9th: its own 3 tokens and its first output token
    assert (first.saved_chunks, first.hit_tokens) == (9, 0)
    assert (second.saved_chunks, second.hit_tokens, second.loaded_chunks) == (1, 32, 8)  # replica 1 loaded 8
    summary = summarize_replicas(fleet)
    assert summary["hit_tokens"] == 32 and summary["shared_tier_hit_tokens"] == 32
    assert summary["shared_tier_hit_tokens_per_replica"] == [0, 32] and summary["shared_tier_held_chunks"] == 10
    assert sum(summary["missed_tokens_by_cause"].values()) == summary["prompt_tokens"] - summary["hit_tokens"]


def hot_prefix(n: int = 48, gap_s: float = 0.005) -> list[Req]:
    """One 64-token prefix (16 pages) and 8 tokens of each request's own, arriving faster than one replica serves."""
    hot = list(range(64))
    return [Req(k * gap_s, hot + [10_000 + 8 * k + i for i in range(8)], output_len=4) for k in range(n)]


def test_precise_spreads_a_hot_prefix_once_the_store_holds_it():
    requests = hot_prefix()
    alone = summarize_replicas(simulate_replicas(config(), requests, CPU, 4, "precise"))
    assert max(alone["routed_per_replica"]) == 48  # without a store every follower herds to the prefix's replica
    fleet = simulate_replicas(config(), requests, CPU, 4, "precise", shared_tier=shared())
    summary = summarize_replicas(fleet)
    assert summary["routed_max_over_mean"] <= 1.5 and min(summary["routed_per_replica"]) >= 6
    assert summary["token_hit_rate"] >= alone["token_hit_rate"]  # spread, and no hit lost: the store serves it
    assert summary["shared_tier_hit_tokens"] > 0
    assert summary["ttft_s"]["p90"] < alone["ttft_s"]["p90"]
    # the router's picture of the store is the store's, once every event due is heard
    fleet.router.kv_events("shared-store", fleet.store.drain_events(float("inf")))
    store_index = fleet.router.policy.store  # type: ignore[attr-defined]
    held = {external_block_hash(key) for key in fleet.store.keys()}
    assert store_index.num_chunks == len(held) and all(store_index.holds(h) for h in held)
    index = fleet.router.policy.index  # type: ignore[attr-defined]
    for i, kv in enumerate(fleet.kvs):  # the per-replica index still mirrors each pool, store events aside
        assert index.blocks(f"replica-{i}") == kv.cached_block_hashes()


def test_the_store_weight_the_router_gets_is_the_cost_models_ratio():
    cost = default_shared_tier_cost(16)
    assert cost.name == "smollm2-redis-amd-epyc" and default_shared_tier_cost(256).name.endswith("-256")
    assert cost.read_s(16) == pytest.approx(0.78e-3, rel=0.01) and cost.write_s(16) == pytest.approx(0.5e-3, rel=0.01)
    assert cost.op_latency_s == pytest.approx(107e-6) and load_tier_cost(cost.name) is cost
    # a 16-token chunk: 0.78 ms read + 0.107 ms EXISTS, against 16 x 0.62 ms computed
    assert remote_block_weight(CPU, cost, 16) == pytest.approx((0.784e-3 + 0.107e-3) / (16 * 0.6208e-3), rel=0.01)
    fleet = simulate_replicas(config(), hot_prefix(4), CPU, 2, "precise", shared_tier=shared())
    assert fleet.router.policy.remote_block_weight == remote_block_weight(CPU, FAST_STORE, PAGE)  # type: ignore[attr-defined]


TRACE = [  # Mooncake format: 512-token blocks, one request a second
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
    {"timestamp": 1000, "input_length": 1536, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 1024, "output_length": 3, "hash_ids": [1, 4]},
    {"timestamp": 3000, "input_length": 1536, "output_length": 3, "hash_ids": [1, 2, 3]},
]


def test_the_shared_tier_from_the_command_line(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    # 16 tokens a block and a page: the store's chunk (16 tokens, the only one a sweep runs) is one page
    argv = ["simulate", "--trace", str(trace), "--tokens-per-block", "16", "--output-scale", "1", "--page-size", "16"]
    argv += ["--kv-cache-tokens", "64", "--replicas", "2", "--quiet", "--no-plot", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    alone = json.loads((tmp_path / "simulate.json").read_text())["summary"]
    assert main([*argv, "--shared-tier-fraction", "2"]) == 0  # round-robin: replica 1 loads what 0 stored
    results = json.loads((tmp_path / "simulate.json").read_text())
    s = results["summary"]
    assert results["shared_tier"]["cost"]["name"] == "smollm2-redis-amd-epyc"
    assert results["shared_tier"]["capacity_tokens"] == 2 * results["unique_prompt_tokens"]
    assert s["shared_tier_hit_tokens"] > 0 and s["hit_tokens"] > alone["hit_tokens"]
    assert s["token_hit_rate"] <= s["offline_bound_hit_rate"] + 1e-9  # the bound counts the store too
    assert "shared tier hit tokens" in capsys.readouterr().out
    sweep = ["simulate", "sweep", *argv[1:9], "--replicas", "2", "--quiet", "--no-plot", "--fractions", "1"]
    sweep += ["--routers", "round-robin,precise", "--shared-tier-fraction", "2", "--output-dir", str(tmp_path)]
    assert main(sweep) == 0
    runs = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert runs[0]["router"] == "round-robin" and runs[0]["shared_tier_hit_tokens"] > 0
    refusals = {
        "--shared-tier-cost": ["--shared-tier-cost", "smollm2-redis-amd-epyc"],  # no store to cost
        "medium 'remote'": ["--shared-tier-fraction", "1", "--shared-tier-cost", "smollm2-disk-amd-epyc"],
        "not simulated": ["--shared-tier-fraction", "1", "--tier-fraction", "1"],
        "must be > 0": ["--shared-tier-fraction", "0"],
    }
    for message, flags in refusals.items():
        assert main([*argv, *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--kv-remote", "redis://127.0.0.1:6390/0"])
    assert "--shared-tier-fraction" in capsys.readouterr().err


def test_a_tier_cost_file_may_leave_the_round_trip_out(tmp_path):
    """Files written before op_latency_s read as a local tier's: no round trip; a negative one is refused."""
    fields = FAST_STORE.to_json()
    del fields["op_latency_s"]
    path = tmp_path / "store.json"
    path.write_text(json.dumps(fields))
    assert load_tier_cost(str(path)).op_latency_s == 0.0
    path.write_text(json.dumps(fields | {"op_latency_s": -1}))
    with pytest.raises(ValueError, match="op_latency_s must be a finite number >= 0"):
        load_tier_cost(str(path))
