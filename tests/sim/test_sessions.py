"""Agent sessions replayed closed loop on a virtual clock: each request arrives its think time after the previous
answer, subagents run concurrently and the parent resumes after the last one, pins hold until their deadline
(only the retention cap ends them early), and `prefixkv simulate sessions` reports hit rates within the offline
bound with every missed token attributed."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from prefixkv.cli import main
from prefixkv.config import EngineConfig
from prefixkv.engine.agent_sessions import SessionPins
from prefixkv.engine.policy_factory import create_policy
from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams
from prefixkv.session_hint import SessionHint
from prefixkv.sim.agent_traces import AgentScaling, SubagentGroup, load_agent_trace, token_mapping
from prefixkv.sim.cost_model import StepCostModel
from prefixkv.sim.sessions import SessionPolicy, add_common_jct, common_sessions, replay_sessions
from prefixkv.sim.simulator import Arrival, SimClock, Simulation, create_kv

SLICE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "claude_code")
CLOCK = StepCostModel("hand", "test", step_overhead_s=1.0, per_token_s=0.1, per_attended_pair_s=0.0)
SCALING = AgentScaling(tokens_per_block=4)


def _request(t: float, blocks: list[int], **kw) -> dict:
    return {"t": t, "type": "n", "in": 64 * len(blocks), "out": 16, "hash_ids": blocks, **kw}


def _replay(tmp_path, session: dict, policy: str = "lru", cache: str = "hash", **config):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(session))
    trace = load_agent_trace(str(path))
    cfg = EngineConfig(prefix_cache=cache, page_size=4, kv_cache_tokens=config.pop("kv_cache_tokens", 256), **config)
    mapping = token_mapping(trace, SCALING)
    result = replay_sessions(cfg, CLOCK, SCALING, mapping, SessionPolicy(policy), trace.sessions, [0.0], check_every=1)
    return trace, result


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_each_request_arrives_its_think_time_after_the_previous_answer(tmp_path, cache):
    session = {
        "requests": [
            _request(0, [1, 2], think_time=0),
            _request(20, [1, 2, 3], think_time=5),
            _request(40, [1, 2, 3, 4], think_time=7),
        ]
    }
    _, result = _replay(tmp_path, session, cache=cache)
    a, b, c = result.answered
    assert a.arrival_s == 0.0
    assert b.arrival_s == pytest.approx(a.answer_s + 5)
    assert c.arrival_s == pytest.approx(b.answer_s + 7)
    # one step of 8 tokens (1 + 0.8 s), then a hit of 8 tokens and 4 computed, ...: the clock is exact
    assert a.answer_s == pytest.approx(1.8)
    assert [r.hit_tokens for r in result.answered] == [0, 8, 12]
    run = result.sessions[0]
    assert run.end_s == pytest.approx(c.answer_s) and result.summary["jct_s"]["max"] == pytest.approx(c.answer_s)


def test_subagents_run_concurrently_and_the_parent_waits_for_the_last(tmp_path):
    sub_a = {"t": 3.0, "type": "subagent", "agent_id": "a", "duration_ms": 20_000}
    sub_a["requests"] = [_request(0, [7], think_time=0), _request(10, [7, 8], think_time=9)]
    sub_b = {"t": 5.0, "type": "subagent", "agent_id": "b", "duration_ms": 4_000, "requests": [_request(0, [9, 10])]}
    session = {
        "requests": [
            _request(0, [1, 2], think_time=0, api_time=1.0),
            sub_a,
            sub_b,
            _request(30, [1, 2, 3], think_time=26),
        ]
    }
    trace, result = _replay(tmp_path, session)
    group = trace.sessions[0].steps[1]
    assert isinstance(group, SubagentGroup) and group.resume_s == pytest.approx(7.0)  # a ended at 23 s, parent at 30
    by_agent: dict[str, list] = {}
    for r in result.answered:
        by_agent.setdefault(r.agent, []).append(r)
    parent, a, b = by_agent["s"], by_agent["s/a"], by_agent["s/b"]
    first_answer = parent[0].answer_s
    assert a[0].arrival_s == pytest.approx(first_answer + 2) and b[0].arrival_s == pytest.approx(first_answer + 4)
    assert b[0].arrival_s < a[-1].answer_s  # the two subagents overlap
    last_sub = max(a[-1].answer_s, b[-1].answer_s)
    assert parent[1].arrival_s == pytest.approx(last_sub + 7.0)
    assert result.sessions[0].end_s == pytest.approx(parent[1].answer_s)


def _serve(sim: Simulation, request_id: str, tokens: list[int]) -> None:
    sim.arrive(Arrival(sim.now(), request_id, len(tokens), 1, tokens.copy))
    while sim.scheduler.has_work():
        sim.step()


def _cached(kv, tokens: list[int]) -> int:
    probe = Request("probe", [*tokens, 0], SamplingParams(max_tokens=1))
    try:
        return kv.lookup(probe)
    finally:
        kv.free(probe)


def _pin(kv, tokens: list[int], seconds: float) -> int:
    probe = Request("pin", [*tokens, 0], SamplingParams(max_tokens=1))
    try:
        return kv.retain_cached(probe, seconds)
    finally:
        kv.free(probe)


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_a_pinned_prefix_outlives_pressure_until_its_deadline_and_only_the_cap_ends_it_early(cache):
    config = EngineConfig(prefix_cache=cache, page_size=4, kv_cache_tokens=64, retained_pool_fraction=0.25)
    clock = SimClock()
    kv = create_kv(config, clock)
    sim = Simulation(config, kv, create_policy(config), CLOCK, sim_clock=clock, check_every=1)
    pinned = list(range(100, 116))  # 4 pages, the cap's whole room
    _serve(sim, "a", pinned)
    deadline = clock.now() + 100.0
    assert _pin(kv, pinned, seconds=100.0) == 4
    for k in range(3):  # each takes 12 of the 16 pages: everything unpinned goes
        _serve(sim, f"flood{k}", list(range(1000 * (k + 1), 1000 * (k + 1) + 44)))
        assert _cached(kv, pinned) == 16
    assert clock.now() < deadline
    sim.wait_until(deadline + 0.5)
    _serve(sim, "after", list(range(9000, 9044)))
    assert _cached(kv, pinned) < 16  # the pin ran out: LRU took the oldest pages
    # the cap: a second prefix pinned for longer takes the room, the first pin is released at once
    _serve(sim, "a2", pinned)
    other = list(range(200, 216))
    _serve(sim, "b", other)
    _pin(kv, pinned, seconds=50.0)
    _pin(kv, other, seconds=500.0)
    assert kv.retention.summary()["retention_released_by_cap"] == 4
    _serve(sim, "flood", list(range(7000, 7044)))
    assert _cached(kv, other) == 16 and _cached(kv, pinned) < 16


def test_release_keeps_the_common_prefix_pinned():
    config = EngineConfig(page_size=4, kv_cache_tokens=64, retained_pool_fraction=0.5)
    clock = SimClock()
    kv = create_kv(config, clock)
    sim = Simulation(config, kv, create_policy(config), CLOCK, sim_clock=clock)
    tokens = list(range(100, 116))
    _serve(sim, "a", tokens)
    _pin(kv, tokens, 100.0)
    probe = Request("release", [*tokens, 0], SamplingParams(max_tokens=1))
    assert kv.release_retention(probe, keep_tokens=8) == 2
    kv.free(probe)
    assert len(kv.retention) == 2


def test_a_session_letting_go_keeps_the_prefix_another_session_still_pins():
    """A subagent and its parent (or two agents behind one system prompt) pin the same first pages; the retention
    table keeps one retention a page, so one session's next turn must not end the other's pin on them."""
    config = EngineConfig(page_size=4, kv_cache_tokens=64, retained_pool_fraction=0.75)
    clock = SimClock()
    kv = create_kv(config, clock)
    pins = SessionPins(kv, "session")
    sim = Simulation(config, kv, create_policy(config), CLOCK, sim_clock=clock, sessions=pins, check_every=1)
    system = list(range(100, 108))  # 2 pages both sessions share

    def turn(request_id: str, tokens: list[int], session: str, parent: str | None = None) -> None:
        arrival = Arrival(sim.now(), request_id, len(tokens), 1, tokens.copy)
        arrival.session = SessionHint(session, parent, 600.0)
        sim.arrive(arrival)
        while sim.scheduler.has_work():
            sim.step()

    turn("parent-1", [*system, *range(200, 208)], "parent")
    turn("child-1", [*system, *range(300, 308)], "child", parent="parent")
    turn("child-2", list(range(400, 412)), "child", parent="parent")  # the child moves on: its old pin goes
    for k in range(3):  # pressure: everything not pinned goes
        _serve(sim, f"flood{k}", list(range(1000 * (k + 1), 1000 * (k + 1) + 28)))
    assert _cached(kv, [*system, *range(200, 208)]) == 16  # the parent's pin is whole, shared pages included
    assert _cached(kv, [*system, *range(300, 308)]) == 8  # of the child's old sequence, only what they share


def test_the_session_policy_lets_go_of_every_pin_when_its_agents_end(tmp_path):
    session = {"requests": [_request(0, [1, 2, 3]), _request(10, [1, 2, 3, 4], think_time=5)]}
    _, session_run = _replay(tmp_path, session, policy="session")
    assert len(session_run.summary) and session_run.summary["policy"] == "session"
    _, ttl_run = _replay(tmp_path, session, policy="ttl")
    # the session ended with its last request (the replay sends "release" there): each policy let go of its pins
    # and forgot the session
    for run in (session_run, ttl_run):
        assert run.summary["tracked_sessions"] == 0
        assert run.summary["session_released_pages"] > 0 and run.summary["session_pinned_pages"] > 0
        assert run.summary["retention_expired"] == 0
    assert [r.hit_tokens for r in session_run.answered] == [r.hit_tokens for r in ttl_run.answered] == [0, 12]


def test_simulate_sessions_on_the_shipped_slice(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["simulate", "sessions", "--trace", SLICE, "--sessions", "4", "--fractions", "0.2,0.5", "--no-plot"]
    assert main([*argv, "--output-dir", str(out), "--max-num-seqs", "8"]) == 0
    results = json.loads((out / "sessions.json").read_text())
    assert sorted({r["policy"] for r in results["runs"]}) == ["lru", "pause", "session", "ttl"]
    for r in results["runs"]:
        # the bound is over the same requests as the hit rate: a rejected request (too long for the small pool)
        # counts in neither
        assert r["token_hit_rate"] <= r["offline_bound_hit_rate"] + 1e-9 <= r["unbounded_hit_rate"] + 2e-9
        assert sum(r["missed_tokens_by_cause"].values()) == r["prompt_tokens"] - r["hit_tokens"]
        assert r["slowdown_vs_solo"]["max"] >= 1.0 - 1e-9
        assert r["sessions"] == 4
        assert (r["rejected_requests"] > 0) == (r["fraction"] == 0.2) == (not r["comparable"])
    # the small pool's sessions skip their rejected requests and end sooner: JCTs compare over the others only
    common = results["common_sessions"]
    skipped = set(results["runs"][0]["rejected_by_session"])
    assert skipped and common == [sid for sid in results["runs"][0]["jct_by_session"] if sid not in skipped]
    for r in results["runs"]:
        assert r["jct_common_s"]["sessions"] == len(common)
        assert r["jct_common_s"]["mean"] == pytest.approx(sum(r["jct_by_session"][s] for s in common) / len(common))
    assert [t["compared_sessions"] for t in results["targets"]] == [4, 4]  # within a pool, every run alike
    assert results["targets"][0]["best_policy"] in {"lru", "pause", "session", "ttl"}
    out = capsys.readouterr().out
    assert "JCT mean s" in out and "common JCT mean s" in out and "lru *" in out


def test_jct_compares_only_over_the_sessions_every_run_served_alike():
    """A run that rejected a session's request ended that session sooner: the session leaves the comparison,
    unless every compared run rejected the same requests of it."""
    small = {"jct_by_session": {"a": 50.0, "b": 10.0}, "rejected_by_session": {"a": ["a:3"]}, "rejected_requests": 1}
    large = {"jct_by_session": {"a": 90.0, "b": 12.0}, "rejected_requests": 0}
    assert common_sessions([small, large]) == ["b"]
    assert common_sessions([small, dict(small)]) == ["a", "b"]
    assert add_common_jct([small, large]) == ["b"]
    assert (small["jct_common_s"]["mean"], large["jct_common_s"]["mean"]) == (10.0, 12.0)
    assert (small["comparable"], large["comparable"]) == (False, True)


def test_the_session_table_is_bounded_and_a_parent_ending_ends_its_subagents():
    config = EngineConfig(page_size=4, kv_cache_tokens=256, retained_pool_fraction=0.9)
    clock = SimClock()
    kv = create_kv(config, clock)
    pins = SessionPins(kv, "session", max_sessions=3)
    sim = Simulation(config, kv, create_policy(config), CLOCK, sim_clock=clock, sessions=pins, check_every=1)

    def turn(request_id: str, tokens: list[int], hint: SessionHint) -> None:
        arrival = Arrival(sim.now(), request_id, len(tokens), 1, tokens.copy)
        arrival.session = hint
        sim.arrive(arrival)
        while sim.scheduler.has_work():
            sim.step()

    turn("p1", list(range(100, 120)), SessionHint("parent", expected_pause_s=5))
    turn("s1", list(range(200, 220)), SessionHint("sub", parent="parent", expected_pause_s=1))
    assert len(pins) == 2 and len(kv.retention) == 10  # each pinned its 5 full pages (prompt + answer)
    turn("p2", list(range(100, 120)) + [7] * 4, SessionHint("parent", action="release"))
    assert len(pins) == 0 and len(kv.retention) == 0  # the parent's end took its subagent's pins too
    for k in range(5):  # more sessions than the table holds: the least recently active go, pins and all
        turn(f"x{k}", list(range(300 + 40 * k, 320 + 40 * k)), SessionHint(f"s{k}", expected_pause_s=1))
    assert len(pins) == 3 and len(kv.retention) == 15
    # let go: the parent's pin when its next turn arrived (re-pinned: the 5 pages it extends), then the parent's
    # and its subagent's at the end, then the two sessions the table dropped
    assert pins.summary()["session_released_pages"] == 5 + 10 + 10


def test_a_served_model_charges_its_serving_overhead_and_the_engine_alone_does_not(tmp_path):
    """StepCostModel.served(): each request reaches the engine serve_per_request_s late and every step with outputs
    pays serve_per_step_s + serve_per_output_token_s per output; `simulate sessions` (the engine alone) neither."""
    session = {"requests": [_request(0, [1, 2], think_time=0), _request(20, [1, 2, 3], think_time=5)]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(session))
    trace = load_agent_trace(str(path))
    cfg = EngineConfig(page_size=4, kv_cache_tokens=256)
    mapping = token_mapping(trace, SCALING)
    fitted = dataclasses.replace(CLOCK, serve_per_request_s=0.5, serve_per_step_s=0.25, serve_per_output_token_s=0.125)
    served = fitted.served()

    def jct(cost: StepCostModel) -> float:
        result = replay_sessions(cfg, cost, SCALING, mapping, SessionPolicy("lru"), trace.sessions, [0.0])
        return result.sessions[0].end_s

    outputs = 2 * SCALING.output_len(trace.sessions[0].steps[0])  # one token a step, one request at a time
    assert jct(served) == pytest.approx(jct(CLOCK) + 2 * 0.5 + outputs * (0.25 + 0.125))
    assert jct(fitted) == jct(served.engine_only()) == jct(CLOCK)
