"""`prefixkv simulate` explains every missed prompt token (cache_miss.py) on the Mooncake trace's first 200
requests (shipped in docs/data), and `--check-causes` tests the explanation: the run without a cause's mechanism
(an unbounded pool, one tenant, a retention without end, pooled routing) wins back the tokens blamed on it. That
share is the evidence; that the causes sum to the missed tokens is a regression guard (true by construction).
Where the pool, not the TTL, binds, an endless retention wins back little of what `expired` blamed; where the TTL
binds (an engine that keeps up, a pool that holds the retained pages), all of it (docs/benchmarks/miss_causes)."""

from __future__ import annotations

import json
import os

import pytest

from prefixkv.cache_miss import CAUSES
from prefixkv.cli import main
from prefixkv.sim.simulator import Tenancy, conversation_key
from prefixkv.sim.traces import ScaledRequest

SLICE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "mooncake_slice.jsonl")


def _simulate(tmp_path, *flags: str) -> dict:
    argv = ["simulate", "--trace", SLICE, "--tokens-per-block", "32", "--page-size", "16", *flags]
    assert main(argv + ["--no-bounds", "--no-plot", "--quiet", "--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "simulate.json").read_text())
    s = results["summary"]
    assert set(s["missed_tokens_by_cause"]) == set(CAUSES)
    # a regression guard, not evidence: the causes partition the missed tokens by construction
    assert sum(s["missed_tokens_by_cause"].values()) == s["prompt_tokens"] - s["hit_tokens"]
    assert s["missed_tokens_by_cause"]["unknown"] == 0  # the simulator keeps every eviction
    return results


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_removing_a_cause_wins_back_what_was_blamed_on_it_unless_another_limit_binds(cache, tmp_path):
    """A 10% pool on the 2-core CPU's cost model, overloaded: an unbounded pool and one tenant win back every token
    blamed on eviction and isolation; an endless retention little of what `expired` blamed, because there the
    pool binds: the cap releases, or the pool evicts, the retained pages before their conversations return."""
    results = _simulate(
        tmp_path, "--kv-cache-fraction", "0.1", "--cache", cache, "--tenants", "3", "--retention-seconds", "5",
        "--retention-share", "0.25", "--check-causes",
    )  # fmt: skip
    blamed = {c for c, tokens in results["summary"]["missed_tokens_by_cause"].items() if tokens}
    assert {"evicted", "expired", "never_seen", "granularity"} <= blamed
    checks = {row["cause"]: row for row in results["cause_checks"]}
    assert {"evicted", "expired"} <= set(checks) <= {"evicted", "expired", "isolated"}
    for row in checks.values():
        assert row["same_requests"] and 0 <= row["won_back_tokens"] <= row["blamed_tokens"]
    assert checks["evicted"]["recovered_share"] == checks.get("isolated", checks["evicted"])["recovered_share"] == 1.0
    assert checks["expired"]["recovered_share"] < 0.5


def test_where_the_ttl_binds_an_endless_retention_wins_back_what_expired_blamed(tmp_path):
    """An engine that keeps up (the H100 preset) and a pool of half the unique tokens whose cap holds the retained
    pages: the 5 s TTL, shorter than the conversations' reuse gaps, is what lets their pages go."""
    results = _simulate(
        tmp_path, "--kv-cache-fraction", "0.5", "--cost-model", "llama3-8b-h100", "--retention-seconds", "5",
        "--retention-share", "0.25", "--retained-pool-fraction", "0.5", "--check-causes",
    )  # fmt: skip
    expired = next(row for row in results["cause_checks"] if row["cause"] == "expired")
    assert expired["blamed_tokens"] > 0 and expired["recovered_share"] == 1.0


def test_behind_a_router_a_page_another_replica_holds_is_routed(tmp_path):
    """Round robin over 4 replicas sends some requests away from the replica that holds their prefix: those pages
    are the router's misses (routed), and pooled routing (one engine with every pool) wins back a share of them
    (not all: one LRU over the pooled pages keeps other pages than four replicas' LRUs did)."""
    flags = ["--kv-cache-fraction", "0.1", "--replicas", "4", "--router", "round-robin", "--check-causes"]
    results = _simulate(tmp_path, *flags, "--cost-model", "llama3-8b-h100")
    assert results["summary"]["missed_tokens_by_cause"]["routed"] > 0
    routed = next(row for row in results["cause_checks"] if row["cause"] == "routed")
    assert routed["without"] == "pooled routing" and 0.4 <= routed["recovered_share"] <= 1.0


def test_tenants_own_conversations_and_a_share_of_them_retains():
    """A trace without sessions (Mooncake) groups a conversation by its first two blocks: every turn of it gets
    the same salt and the same retention; --retention-share picks whole conversations."""
    turn = [ScaledRequest(0.0, 1, None, 64, (0, 7, 8)), ScaledRequest(5.0, 1, None, 96, (0, 7, 8, 9))]
    other = ScaledRequest(1.0, 1, None, 64, (0, 11, 12))
    assert conversation_key(turn[0], 0) == conversation_key(turn[1], 1) != conversation_key(other, 2)
    assert conversation_key(ScaledRequest(0.0, 1, "chat-3", 64, (0, 7)), 0) == "chat-3"
    tenancy = Tenancy(tenants=4, retention_seconds=60.0, retention_share=0.25)
    keys = [f"blocks:0-{i}" for i in range(2000)]
    assert 0.2 < sum(tenancy.retention(k) == 60.0 for k in keys) / len(keys) < 0.3
    assert {tenancy.salt(k) for k in keys} == {f"tenant-{i}" for i in range(4)}
    with pytest.raises(ValueError, match="retention-share needs --retention-seconds"):
        Tenancy(retention_share=0.5)
    with pytest.raises(ValueError, match="retention-share"):
        Tenancy(retention_seconds=1.0, retention_share=0.0)
