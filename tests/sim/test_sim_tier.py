"""The second KV tier in the simulator: its channels on the virtual clock, and agent sessions replayed with it
(tier hits reported apart, within the pool + tier bound, every miss attributed; reading ahead before a pause ends
takes the reads off the steps)."""

from __future__ import annotations

import json
import os

import pytest

from prefixkv.cli import main
from prefixkv.config import EngineConfig
from prefixkv.sim import bounds
from prefixkv.sim.agent_traces import AgentScaling, load_agent_trace, token_mapping
from prefixkv.sim.session_command import start_times, working_set
from prefixkv.sim.sessions import SessionPolicy, replay_sessions
from prefixkv.sim.tier import SimTier, SimTierOptions, TierCost, load_tier_cost

SLICE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "claude_code")
# one simulated byte a token: a 16-token chunk reads in 1 s and writes in 2 s
SLOW = TierCost("slow", "test", "disk", kv_bytes_per_token=1, read_bytes_per_s=16.0, write_bytes_per_s=8.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_tier_channels_run_on_the_virtual_clock():
    clock = Clock()
    tier = SimTier(64, 16, "xxhash", SLOW, clock, max_pending_bytes=40)
    chunk = bytes(16)
    tier.put(b"a", chunk)
    tier.put(b"b", chunk)  # queued behind a's write
    clock.t = 1.9
    assert not tier.contains(b"a") and tier.get(b"a") is None  # readable once written (2 s)
    clock.t = 4.0
    assert tier.contains(b"a") and tier.contains(b"b")
    clock.t = 5.0
    assert tier.get(b"a") == chunk and tier.get(b"b") == chunk  # two synchronous reads in one step: 1 s each
    assert tier.take_stall() == pytest.approx(2.0) and tier.take_stall() == 0.0
    clock.t = 10.0
    tier.read_ahead(b"a")  # done at 11
    clock.t = 10.5
    assert tier.get(b"a") == chunk and tier.take_stall() == pytest.approx(0.5)  # only what is left of it
    tier.put(b"c", chunk)
    tier.put(b"d", chunk)
    tier.put(b"e", chunk)  # 2 + 2 + 2 s queued: more than 40 bytes / 8 B/s = 5 s pending: dropped
    assert tier.dropped_writes == 1 and not tier.contains(b"e")
    clock.t = 20.0
    tier.put(b"f", chunk)  # 5 chunks for 4: the least recently used (b) goes
    assert tier.stats.evicted == 1 and not tier.contains(b"b") and tier.contains(b"a")


def test_tier_costs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="medium"):
        TierCost("x", "test", "tape", 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        TierCost("x", "test", "host", 1, 0.0, 1.0)
    bad = tmp_path / "cost.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="exactly"):
        load_tier_cost(str(bad))
    with pytest.raises(ValueError, match="neither a preset"):
        load_tier_cost(str(tmp_path / "missing.json"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SLOW.to_json()))
    assert load_tier_cost(str(good)) == SLOW


@pytest.fixture(scope="module")
def slice_runs():
    """The shipped sessions on a pool of a quarter of their working set: without a tier, and with one as large as
    the working set (LRU, and LRU reading ahead before each announced pause ends)."""
    trace = load_agent_trace(SLICE)
    scaling = AgentScaling(tokens_per_block=4)
    mapping = token_mapping(trace, scaling)
    need = working_set(trace.sessions, scaling)
    config = EngineConfig(page_size=16, kv_cache_tokens=need // 4 // 16 * 16, retained_pool_fraction=0.9)
    cost = load_tier_cost("smollm2-disk-amd-epyc")
    from prefixkv.sim.cost_model import PRESETS

    starts = start_times(len(trace.sessions), 60.0, 0)
    tier = SimTierOptions(need // 16 * 16, cost)
    runs = {
        name: replay_sessions(
            config, PRESETS["smollm2-cpu-2t"], scaling, mapping, SessionPolicy(name), trace.sessions, starts,
            check_every=7, tier=tier if with_tier else None,
        )
        for name, with_tier in (("lru", False), ("session", True), ("session+prefetch", True))
    }  # fmt: skip
    return config, tier, runs


def test_a_tier_turns_pool_misses_into_tier_hits_within_the_bound(slice_runs):
    config, tier, runs = slice_runs
    pool_only, tiered, ahead = runs["lru"].summary, runs["session"].summary, runs["session+prefetch"].summary
    assert tiered["token_hit_rate"] > pool_only["token_hit_rate"]
    assert tiered["tier_hit_tokens"] > 0 and "tier_hit_tokens" not in pool_only
    page = config.tokens_per_page
    for result in runs.values():
        s = result.summary
        assert sum(s["missed_tokens_by_cause"].values()) == s["prompt_tokens"] - s["hit_tokens"]
        capacity = (config.kv_cache_tokens + (tier.capacity_tokens if "tier" in s else 0)) // page
        acc = bounds.page_accesses(result.served, page)
        assert s["token_hit_rate"] <= bounds.offline_hit_tokens(acc, page, capacity).rate + 1e-9
    # reading ahead before the announced pause ends takes most tier reads off the steps
    assert ahead["tier_read_ahead_chunks"] > tiered["tier_read_ahead_chunks"]
    assert ahead["tier_stall_s"] < tiered["tier_stall_s"] / 2


def test_demote_needs_a_tier_and_a_policy_name_is_checked():
    with pytest.raises(ValueError, match="only demote and prefetch"):
        SessionPolicy("session+flush")
    trace = load_agent_trace(SLICE)
    scaling = AgentScaling(tokens_per_block=4)
    config = EngineConfig(page_size=16, kv_cache_tokens=4096)
    from prefixkv.sim.cost_model import PRESETS

    with pytest.raises(ValueError, match="second tier"):
        replay_sessions(
            config, PRESETS["smollm2-cpu-2t"], scaling, token_mapping(trace, scaling), SessionPolicy("lru+demote"),
            trace.sessions[:1], [0.0],
        )  # fmt: skip


def test_simulate_sessions_with_a_tier(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["simulate", "sessions", "--trace", SLICE, "--sessions", "2", "--fractions", "0.25", "--no-plot"]
    argv += ["--tier-fractions", "0,1", "--policies", "lru,lru+demote+prefetch", "--no-solo"]
    argv += ["--kv-offload-write-policy", "write_back", "--output-dir", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "sessions.json").read_text())
    labels = [r["label"] for r in results["runs"]]
    assert labels == ["lru", "lru tier 1", "lru+demote+prefetch tier 1"]  # tier actions only run with a tier
    demoted = results["runs"][2]
    assert demoted["session_demoted_chunks"] > 0 and demoted["tier_hit_tokens"] > 0
    assert results["tier_cost"]["name"] == "smollm2-disk-amd-epyc"
    assert "tier hit" in capsys.readouterr().out
    assert main([*argv[:8], "--policies", "session+prefetch", "--output-dir", str(out)]) == 2
    assert "needs --tier-fractions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--kv-offload-dir", str(tmp_path)])  # the simulated tier has no files


def test_simulate_a_trace_with_a_tier(tmp_path, capsys):
    trace = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "mooncake_slice.jsonl")
    argv = ["simulate", "--trace", trace, "--tokens-per-block", "32", "--kv-cache-fraction", "0.1", "--quiet"]
    argv += ["--no-plot", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    pool_only = json.loads((tmp_path / "simulate.json").read_text())["summary"]
    assert main([*argv, "--tier-fraction", "1"]) == 0
    results = json.loads((tmp_path / "simulate.json").read_text())
    tiered = results["summary"]
    assert tiered["token_hit_rate"] > pool_only["token_hit_rate"] and tiered["tier_hit_tokens"] > 0
    assert tiered["token_hit_rate"] <= tiered["offline_bound_hit_rate"] + 1e-9  # over the pool and the tier
    assert sum(tiered["missed_tokens_by_cause"].values()) == tiered["prompt_tokens"] - tiered["hit_tokens"]
    assert results["tier"]["cost"]["name"] == "smollm2-disk-amd-epyc"
    assert "tier hit tokens" in capsys.readouterr().out
    assert main([*argv, "--tier-fraction", "1", "--replicas", "2"]) == 2
    assert "one engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a sweep runs no tier: the engine's tier flags stay refused there
        main(["simulate", "sweep", "--trace", trace, "--kv-offload-chunk-tokens", "32"])
    assert main([*argv, "--kv-offload-write-policy", "write_back"]) == 2  # no tier: the flag would do nothing
    assert "no tier without --tier-fraction" in capsys.readouterr().err
