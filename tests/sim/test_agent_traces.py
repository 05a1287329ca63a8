"""The coding-agent trace loader (kv-cache-tester's Claude Code format): the shipped slice as a set of sessions
with their subagent groups, ids per session, facts, scaling, and a clear error for every malformed field."""

from __future__ import annotations

import json
import os

import pytest

from prefixkv.cli import main
from prefixkv.sim.agent_traces import (
    AgentRequest,
    AgentScaling,
    SubagentGroup,
    describe,
    draw_sessions,
    load_agent_trace,
    scaled_prompt,
    session_hit_rate,
    token_mapping,
)
from prefixkv.sim.traces import TraceFormatError
from tests.shared_data import CLAUDE_CODE, shared_trace

SLICE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "claude_code")


def _request(t: float, n_in: int, ids: list[int], **kw) -> dict:
    return {"t": t, "type": "n", "in": n_in, "out": kw.pop("out", 10), "hash_ids": ids, **kw}


def _write(tmp_path, session: dict | list | str, name: str = "s.json") -> str:
    path = tmp_path / name
    path.write_text(session if isinstance(session, str) else json.dumps(session))
    return str(path)


def test_the_shipped_slice_loads_with_its_subagent_group():
    trace = load_agent_trace(SLICE)
    assert [s.id for s in trace.sessions] == ["trace_0274", "trace_0297", "trace_0702", "trace_0719"]
    head = trace.sessions[0]
    assert [type(s).__name__ for s in head.steps] == ["AgentRequest", "SubagentGroup", *["AgentRequest"] * 3]
    group = head.steps[1]
    assert isinstance(group, SubagentGroup)
    assert [a.kind for a in group.agents] == ["Explore"] * 3
    assert [len(a.steps) for a in group.agents] == [11, 13, 24]
    assert group.delays_s[0] <= group.delays_s[1] <= group.delays_s[2]  # started together, at recorded offsets
    assert head.num_subagents() == 3
    # local ids: the same raw id in two files is two blocks; within a file (subagents included) one
    first = [s.requests()[0].block_ids[0] for s in trace.sessions]
    assert len(set(first)) == 4
    facts = describe(trace)
    assert facts["sessions"] == 4 and facts["subagents"] == 3
    assert facts["requests"] == sum(len(s.requests()) for s in trace.sessions)
    assert 0.5 < facts["session_hit_rate_median"] < 1


def test_the_unbounded_hit_rate_counts_whole_blocks_of_the_leading_run(tmp_path):
    session = {"requests": [_request(0, 200, [1, 2, 3]), _request(5, 210, [1, 2, 9])]}
    trace = load_agent_trace(_write(tmp_path, session))
    # the second request hits blocks 1 and 2 (128 tokens); the first hits nothing
    assert session_hit_rate(trace.sessions[0]) == pytest.approx(128 / 410)


def test_a_missing_think_time_is_the_gap_since_the_previous_answer(tmp_path):
    session = {"requests": [_request(0, 64, [1], api_time=2.0), _request(10, 64, [1])]}
    trace = load_agent_trace(_write(tmp_path, session))
    steps = trace.sessions[0].steps
    assert isinstance(steps[1], AgentRequest) and steps[1].think_s == 8.0


def test_a_subagent_group_resumes_the_parent_after_its_last_member(tmp_path):
    sub = {"type": "subagent", "duration_ms": 30_000, "requests": [_request(0, 64, [5])]}
    session = {
        "requests": [
            _request(0, 64, [1], api_time=1.0),
            {**sub, "t": 3.0, "agent_id": "a"},
            {**sub, "t": 5.0, "agent_id": "b", "duration_ms": 50_000},
            _request(60.0, 128, [1, 2], think_time=59.0),
        ]
    }
    steps = load_agent_trace(_write(tmp_path, session)).sessions[0].steps
    group = steps[1]
    assert isinstance(group, SubagentGroup)
    assert group.delays_s == (2.0, 4.0)  # after the answer at 1 s
    assert group.resume_s == 5.0  # b ended at 55 s, the parent went on at 60 s
    assert [a.id for a in group.agents] == ["s/a", "s/b"]
    # an async-launched subagent records no duration (as in the upstream set): its own requests' span stands for it
    async_sub = {**sub, "t": 3.0, "duration_ms": None, "status": "async_launched"}
    async_sub["requests"] = [_request(0, 64, [5], api_time=2.0), _request(10, 64, [5], api_time=4.0)]
    session["requests"][1:3] = [async_sub]
    group = load_agent_trace(_write(tmp_path, session)).sessions[0].steps[1]
    assert group.agents[0].recorded_s == 14.0 and group.resume_s == 60.0 - 17.0


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", r"s\.json: not valid JSON"),
        ("[]", "expected a JSON object"),
        ({"requests": []}, "requests: must be a non-empty list"),
        ({"requests": [{"t": 0, "in": 64, "out": 1}]}, r"requests\[0\]: field 'hash_ids' must be a list"),
        ({"requests": [{"t": 0, "out": 1, "hash_ids": [1]}]}, r"requests\[0\]: field 'in' is missing"),
        ({"requests": [_request(0, 64.5, [1])]}, "field 'in' must be an integer"),
        ({"requests": [_request(0, 200, [1, 2])]}, "has 2 ids but 'in' 200 has 3 full blocks"),
        ({"requests": [_request(5, 64, [1]), _request(2, 64, [1])]}, r"requests\[1\]: field 't' goes back"),
        ({"requests": [_request(0, 64, [1], think_time="x")]}, "field 'think_time' must be a finite number"),
        ({"requests": [_request(0, 0, [])]}, "field 'in' is 0"),
        ({"block_size": 32, "requests": [_request(0, 64, [1])]}, "field 'block_size' is 32"),
        ({"hash_id_scope": "team", "requests": [_request(0, 64, [1])]}, "'hash_id_scope' must be 'local' or 'global'"),
        (
            {"requests": [_request(0, 64, [1]), {"t": 1, "type": "subagent", "requests": [_request(0, 64, [1])]}]},
            r"requests\[1\]: field 'duration_ms' is missing",
        ),
        (
            {"requests": [{"t": 1, "type": "subagent", "duration_ms": 5, "requests": [_request(0, 64, [-1])]}]},
            r"requests\[0\]\.requests\[0\]: field 'hash_ids'",
        ),
    ],
)
def test_a_malformed_session_names_the_file_the_request_and_the_field(tmp_path, content, message):
    with pytest.raises(TraceFormatError, match=message):
        load_agent_trace(_write(tmp_path, content))


def test_an_empty_directory_is_an_error(tmp_path):
    with pytest.raises(TraceFormatError, match="no .json session files"):
        load_agent_trace(str(tmp_path))


def test_scaling_keeps_whole_blocks_and_gives_the_tail_its_own_run(tmp_path):
    session = {"requests": [_request(0, 200, [1, 2, 3]), _request(5, 192, [1, 2, 3])]}
    trace = load_agent_trace(_write(tmp_path, session))
    scaling = AgentScaling(tokens_per_block=4)
    mapping = token_mapping(trace, scaling)
    a, b = (scaled_prompt(r, scaling, mapping) for r in trace.sessions[0].requests())
    assert (a.prompt_len, len(a.block_ids)) == (13, 4)  # 3 blocks of 4, the 8-token tail -> 1 token of its own
    assert (b.prompt_len, len(b.block_ids)) == (12, 3)
    assert a.prompt_tokens()[:12] == b.prompt_tokens()
    assert scaling.output_len(trace.sessions[0].requests()[0]) == 1  # 10 x 4/64, at least 1
    assert AgentScaling(4, max_think_s=60).pause(600) == 60
    with pytest.raises(ValueError, match="tokens_per_block"):
        AgentScaling(tokens_per_block=0)


def test_the_draw_is_seeded_and_repeats_only_when_the_set_runs_out():
    trace = load_agent_trace(SLICE)
    a, b = draw_sessions(trace, 6, seed=3), draw_sessions(trace, 6, seed=3)
    assert [s.id for s in a] == [s.id for s in b]
    assert len({s.id for s in a[:4]}) == 4
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        draw_sessions(trace, 0, seed=0)


def test_describe_from_the_cli(capsys):
    assert main(["simulate", "--describe", "--trace", SLICE]) == 0
    out = capsys.readouterr().out
    assert "session_hit_rate_median" in out and "subagents" in out
    mooncake = os.path.join(SLICE, "..", "mooncake_slice.jsonl")
    assert main(["simulate", "--describe", "--trace", mooncake]) == 0
    out = capsys.readouterr().out
    assert "unbounded_hit_rate  0.0593" in out and "requests            200" in out  # docs/data/README.md: 5.9%


def test_the_shared_sample_loads_whole():
    facts = describe(load_agent_trace(str(shared_trace(CLAUDE_CODE))))
    assert facts["sessions"] == 48 and facts["requests"] == 3453 and facts["subagents"] == 9
