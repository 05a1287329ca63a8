"""`prefixkv simulate` explains every missed prompt token (cache_miss.py) on the Mooncake trace's first 200
requests (shipped in docs/data), and the explanation holds up: removing a cause in a run of its own (an unbounded
pool, one tenant, a retention without end) brings back the hits it was blamed for, within half a point (the
whole trace's gaps, and where an endless retention costs other pages their hits: docs/simulate.md)."""

from __future__ import annotations

import json
import os

import pytest

from prefixkv.cache_miss import CAUSES
from prefixkv.cli import main
from prefixkv.sim.simulator import Tenancy, conversation_key
from prefixkv.sim.traces import ScaledRequest

SLICE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "mooncake_slice.jsonl")


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_every_missed_token_has_a_cause_and_removing_one_recovers_its_hits(cache, tmp_path):
    argv = ["simulate", "--trace", SLICE, "--tokens-per-block", "32", "--kv-cache-fraction", "0.1", "--cache", cache]
    argv += [
        "--page-size",
        "16",
        "--tenants",
        "3",
        "--retention-seconds",
        "5",
        "--retention-share",
        "0.25",
        "--check-causes",
        "--no-bounds",
        "--no-plot",
        "--quiet",
    ]
    assert main(argv + ["--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "simulate.json").read_text())
    s = results["summary"]
    by_cause = s["missed_tokens_by_cause"]
    assert set(by_cause) == set(CAUSES)
    assert sum(by_cause.values()) == s["prompt_tokens"] - s["hit_tokens"]  # 100% attributed, exactly
    blamed = {c for c, tokens in by_cause.items() if tokens}
    assert {"evicted", "never_seen", "granularity"} <= blamed
    checks = {row["cause"]: row for row in results["cause_checks"]}
    assert {"evicted", "expired"} <= set(checks)
    for row in checks.values():
        assert abs(row["gap_points"]) <= 0.5, row


def test_behind_a_router_a_page_another_replica_holds_is_routed(tmp_path):
    """Round robin over 4 replicas sends some requests away from the replica that holds their prefix: those pages
    are the router's misses (routed), and the causes still sum exactly over the fleet."""
    argv = ["simulate", "--trace", SLICE, "--tokens-per-block", "32", "--page-size", "16", "--kv-cache-fraction", "0.1"]
    argv += ["--replicas", "4", "--router", "round-robin", "--no-bounds", "--no-plot", "--quiet"]
    assert main(argv + ["--output-dir", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "simulate.json").read_text())["summary"]
    assert s["missed_tokens_by_cause"]["routed"] > 0
    assert sum(s["missed_tokens_by_cause"].values()) == s["prompt_tokens"] - s["hit_tokens"]


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
