"""Trace loaders and rescaling: tiny hand-made traces of both formats, every error, the real Mooncake trace."""

from __future__ import annotations

import json

import pytest

from prefixkv.engine.prompts import shared_prefix
from prefixkv.sim.traces import TraceFormatError, TraceScaling, load_trace, scale_trace, scaled_length
from tests.shared_data import MOONCAKE, shared_trace


def write(tmp_path, rows, name="t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def mooncake_row(ts=0, n=1024, out=10, ids=(0, 1)) -> dict:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids)}


def bailian_row(chat=1, parent=-1, ts=0.0, n=40, out=5, turn=1, ids=(0, 1, 2)) -> dict:
    return {
        "chat_id": chat,
        "parent_chat_id": parent,
        "timestamp": ts,
        "input_length": n,
        "output_length": out,
        "turn": turn,
        "type": "text",  # extra fields are ignored
        "hash_ids": list(ids),
    }


def test_mooncake_loads_detected_sorted_and_rebased(tmp_path):
    path = write(
        tmp_path,
        [
            mooncake_row(ts=1000, n=1100, ids=(0, 1, 2)),
            "",  # blank lines are skipped
            mooncake_row(ts=3500, n=512, ids=(0,)),
            mooncake_row(ts=500, n=600, out=0, ids=(0, 7)),  # out of order: sorted in, stably
        ],
    )
    trace = load_trace(path)
    assert (trace.format, trace.block_size, trace.path) == ("mooncake", 512, path)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 3.0]
    assert [r.block_ids for r in trace.requests] == [(0, 7), (0, 1, 2), (0,)]
    assert trace.requests[0].output_length == 0 and trace.requests[0].session is None
    assert len(load_trace(path, limit=2).requests) == 2


def test_bailian_loads(tmp_path):
    path = write(
        tmp_path,
        [bailian_row(chat=7, ts=10.5), bailian_row(chat="8", parent=7, ts=12.0, n=33, turn=2, ids=(0, 1, 2))],
    )
    trace = load_trace(path)
    assert (trace.format, trace.block_size) == ("bailian", 16)
    assert [(r.arrival_s, r.session, r.input_length) for r in trace.requests] == [(0.0, "7", 40), (1.5, "8", 33)]
    assert load_trace(path, format="bailian").requests == trace.requests


@pytest.mark.parametrize(
    "fmt, line, field, text",
    [
        ("mooncake", "{not json", None, "not valid JSON"),
        ("mooncake", "[1, 2]", None, "expected a JSON object"),
        ("mooncake", {"timestamp": 0, "input_length": 5, "hash_ids": [0]}, "output_length", "missing"),
        ("mooncake", mooncake_row(ts="soon"), "timestamp", "finite number"),
        ("mooncake", mooncake_row(n=-1, ids=()), "input_length", ">= 0"),
        ("mooncake", mooncake_row(n=12.5), "input_length", "integer"),
        ("mooncake", mooncake_row(out=True), "output_length", "integer"),
        ("mooncake", mooncake_row(ids=(0, "a")), "hash_ids", "list of integers"),
        ("mooncake", mooncake_row(ids=(0, -2)), "hash_ids", "list of integers"),
        ("mooncake", mooncake_row(n=1025, ids=(0, 1)), "hash_ids", "needs 3 blocks of 512"),
        ("mooncake", bailian_row(), "hash_ids", "needs 1 blocks of 512"),  # the first line fixes the format
        ("bailian", {**bailian_row(), "turn": -1}, "turn", ">= 0"),
        ("bailian", {**bailian_row(), "chat_id": [1]}, "chat_id", "integer or a string"),
        ("bailian", {k: v for k, v in bailian_row().items() if k != "parent_chat_id"}, "parent_chat_id", "missing"),
        ("bailian", bailian_row(n=40, ids=(0, 1)), "hash_ids", "needs 3 blocks of 16"),
    ],
)
def test_every_error_names_file_line_and_field(tmp_path, fmt, line, field, text):
    first = mooncake_row() if fmt == "mooncake" else bailian_row()
    path = write(tmp_path, [first, first, line if isinstance(line, str) else json.dumps(line)])
    with pytest.raises(TraceFormatError) as e:
        load_trace(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ")
    if field:
        assert f"field {field!r}" in msg
    if text:
        assert text in msg


def test_unknown_or_undetectable_format_and_empty_file(tmp_path):
    path = write(tmp_path, [{"ts": 1, "prompt": "hi"}])
    with pytest.raises(TraceFormatError, match=r":1: neither a mooncake line .* fields are \['prompt', 'ts'\]"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match="unknown trace format 'sharegpt'"):
        load_trace(path, format="sharegpt")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(write(tmp_path, [""], "empty.jsonl"))


def test_scaled_prompts_share_exactly_the_trace_prefixes(tmp_path):
    rows = [
        mooncake_row(ts=0, n=3 * 512, out=64, ids=(0, 1, 2)),
        mooncake_row(ts=100, n=2 * 512 + 200, out=1, ids=(0, 1, 3)),  # shares 2 blocks, partial last block
        mooncake_row(ts=200, n=512 + 1, out=100, ids=(0, 4)),  # shares 1 block; a 1-token tail keeps >= 1 token
        mooncake_row(ts=300, n=100, out=512, ids=(5,)),  # shares nothing (5 differs from 0 in the first token)
        mooncake_row(ts=400, n=2 * 512, out=3, ids=(0, 1)),  # a whole prefix of the first request
        mooncake_row(ts=500, n=3 * 512, out=3, ids=(5 + 48_900, 1, 2)),  # same low digit as id 5, other run
    ]
    trace = load_trace(write(tmp_path, rows))
    scaling = TraceScaling(tokens_per_block=16, time_scale=0.5)
    reqs = scale_trace(trace, scaling)
    assert [r.prompt_len for r in reqs] == [48, 32 + 6, 16 + 1, 3, 32, 48]
    assert [r.output_len for r in reqs] == [2, 1, 3, 16, 1, 1]  # x16/512, rounded, >= 1
    assert [r.arrival_s for r in reqs] == [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]
    prompts = [r.prompt_tokens() for r in reqs]
    assert [len(p) for p in prompts] == [r.prompt_len for r in reqs]
    assert all(100 <= t < 49_000 for p in prompts for t in p)
    assert shared_prefix(prompts[0], prompts[1]) == 32
    assert shared_prefix(prompts[0], prompts[2]) == 16
    assert shared_prefix(prompts[0], prompts[3]) == 0
    assert prompts[4] == prompts[0][:32]
    assert shared_prefix(prompts[3], prompts[5]) == 1  # ids equal modulo the vocabulary: only the first digit
    assert prompts[5][16:] == prompts[0][16:]  # same ids, same runs, wherever they stand
    # deterministic from the seed, different under another seed
    assert scale_trace(trace, scaling)[0].prompt_tokens() == prompts[0]
    assert scale_trace(trace, scaling, seed=1)[0].prompt_tokens() != prompts[0]
    # full length: every token of the trace
    full = scale_trace(trace, TraceScaling())
    assert [r.prompt_len for r in full] == [r["input_length"] for r in rows]
    assert [r.output_len for r in full] == [64, 1, 100, 512, 3, 3]
    assert shared_prefix(full[0].prompt_tokens(), full[1].prompt_tokens()) == 1024


def test_runs_of_distinct_ids_never_collide():
    from prefixkv.sim.traces import BlockTokens

    ids = tuple(range(0, 3 * 200, 3)) + (48_900, 2 * 48_900, 48_900**2 - 1)
    mapping = BlockTokens(2, max(ids), seed=3)
    runs = {tuple(mapping.tokens((i,), 2)) for i in ids}
    assert len(runs) == len(ids)
    with pytest.raises(ValueError, match="use more tokens per block"):
        BlockTokens(1, 48_900)


def test_slicing_output_scale_and_describe(tmp_path):
    rows = [mooncake_row(ts=1000 * t, n=512, out=100, ids=(t,)) for t in range(10)]
    trace = load_trace(write(tmp_path, rows))
    scaling = TraceScaling(
        tokens_per_block=8, time_scale=2.0, output_scale=0.1, start_s=3, duration_s=5, max_requests=3
    )
    reqs = scale_trace(trace, scaling)
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 4.0]  # rebased to the slice's first request, then x2
    assert [r.prompt_tokens() for r in reqs] == [
        scale_trace(trace, TraceScaling(8))[t].prompt_tokens() for t in (3, 4, 5)
    ]
    assert [r.output_len for r in reqs] == [10, 10, 10]
    assert scaling.describe(512) == ("512->8 tokens/block, time x2, output x0.1, first 3 requests of trace seconds 3-8")
    assert TraceScaling().describe(512) == "512->512 tokens/block, time x1, output x1, all requests"
    with pytest.raises(ValueError, match="no requests in the slice"):
        scale_trace(trace, TraceScaling(start_s=100))
    for bad in ({"tokens_per_block": 0}, {"time_scale": -1}, {"output_scale": 0}, {"max_requests": 0}):
        with pytest.raises(ValueError):
            TraceScaling(**bad)
    assert scaled_length(1000, 512, 16) == 16 + 15 and scaled_length(513, 512, 16) == 17


def test_real_mooncake_trace_loads():
    trace = load_trace(str(shared_trace(MOONCAKE)))
    assert trace.format == "mooncake" and len(trace.requests) == 12_031
    assert round(trace.requests[-1].arrival_s) == 3_537
    assert max(r.input_length for r in trace.requests) == 126_195
    reqs = scale_trace(trace, TraceScaling(tokens_per_block=16, max_requests=50))
    assert len(reqs) == 50 and all(len(r.prompt_tokens()) == r.prompt_len for r in reqs)


def test_missing_shared_data_skips_here_and_fails_in_ci(tmp_path, monkeypatch):
    """tests/shared_data.py: a test reading the shared traces skips where they are not, but not in CI."""
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="missing"):
        shared_trace(MOONCAKE, root=tmp_path)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must provide it"):
        shared_trace(MOONCAKE, root=tmp_path)
    (tmp_path / MOONCAKE).write_text("")
    assert shared_trace(MOONCAKE, root=tmp_path) == tmp_path / MOONCAKE
