"""The HTTP benchmark client against a real server on the default model: every workload, tiny sizes."""

from __future__ import annotations

import argparse
import json

import pytest

from prefixkv.bench.serve_client import _dist, add_arguments, plot, run
from prefixkv.sim.bounds import unbounded_hit_tokens
from prefixkv.sim.traces import TraceScaling, load_trace, scale_trace
from tests.server.live_server import running_server


def _args(base: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(
        [
            "--base-url",
            base + "/v1",
            "--api-key",
            "k",
            "--system-prompt-tokens",
            "20",
            "--output-tokens",
            "4",
            "--concurrency",
            "3",
            "--ignore-eos",
            *extra,
        ]
    )


def test_bench_serve_workloads(tmp_path, new_engine):
    # holds every request below, and the session replay's warm-up request filling its 1024-token --sim pool
    engine = new_engine(kv_cache_tokens=1280)
    with running_server(engine, api_key="k") as (base, _, _):
        res = run(_args(base, "--num-requests", "5"))
        assert res["num_ok"] == 5 and res["num_errors"] == 0
        assert res["output_tokens"] == 20 and res["prompt_tokens"] > 100
        assert res["ttft_ms"]["p50"] > 0 and res["output_throughput_tok_s"] > 0
        assert res["config"]["model"] == engine.model_name
        assert res["cached_tokens"] > 0

        res = run(_args(base, "--workload", "multi-turn", "--num-requests", "6", "--turns", "3", "--turn-tokens", "5"))
        assert res["num_ok"] == 6
        assert sorted(res["per_turn"]) == [1, 2, 3]
        assert res["per_turn"][3]["prompt_tokens"] > res["per_turn"][1]["prompt_tokens"]
        plot(res, str(tmp_path / "multi_turn.png"))
        assert (tmp_path / "multi_turn.png").stat().st_size > 0

        res = run(_args(base, "--workload", "multi-tenant", "--tenants", "2", "--num-requests", "4"))
        assert res["num_ok"] == 4 and res["config"]["tenants"] == 2
        keyed = run(_args(base, "--workload", "multi-tenant", "--num-requests", "1", "--tenant-api-keys", "nope"))
        assert keyed["num_errors"] == 1 and "401" in keyed["errors"][0]  # the tenant's own key was sent

        bad = run(_args(base, "--num-requests", "1", "--model", "nope"))
        assert bad["num_errors"] == 1 and "404" in bad["errors"][0]

        check_trace_replay(base, tmp_path)  # on the same server: one engine and server start for the file
        check_session_replay(base, tmp_path, engine)


def test_percentiles_nearest_rank():
    d = _dist([i / 1000 for i in range(1, 101)])
    assert d["p50"] == 50 and d["p99"] == 99 and abs(d["mean"] - 50.5) < 1e-9


def _trace_file(tmp_path) -> str:
    """Six Mooncake-format requests of 512-token blocks: a shared first block, one conversation growing."""
    rows = [
        (0, 1300, [0, 1, 2]),
        (100, 1100, [0, 3, 4]),
        (200, 1536, [0, 1, 2]),
        (250, 2000, [0, 1, 2, 5]),
        (400, 600, [6, 7]),
        (500, 1024, [0, 3]),
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 96, "hash_ids": ids}) + "\n"
            for t, n, ids in rows
        )
    )
    return str(path)


def check_trace_replay(base: str, tmp_path) -> None:
    """A warm-up replay of the first request, then the slice: every request must hit at least the pages it
    shares with the first (they stay cached in a pool that holds everything), whatever the timing."""
    trace = _trace_file(tmp_path)
    flags = ["--trace", trace, "--tokens-per-block", "16", "--time-scale", "0.5"]
    requests = scale_trace(load_trace(trace), TraceScaling(tokens_per_block=16))
    # what each request hits when only the first was seen before: whole pages, at most prompt_len - 1 tokens
    at_least = sum(unbounded_hit_tokens([requests[0], r], 16).per_request[1] for r in requests)
    assert at_least == 32 + 16 + 32 + 32 + 0 + 16
    warm = run(_args(base, *flags, "--max-requests", "1"))
    assert warm["num_ok"] == 1 and warm["cached_tokens"] == 0
    res = run(_args(base, *flags))
    assert res["num_ok"] == 6 and res["num_errors"] == 0
    assert res["prompt_tokens"] == res["expected_prompt_tokens"] == sum(r.prompt_len for r in requests) == 236
    assert res["output_tokens"] == res["expected_output_tokens"] == 6 * 3  # 96 * 16 / 512, ignore_eos
    assert res["scaling"] == "512->16 tokens/block, time x0.5, output x0.03125, all requests"
    assert res["config"]["trace_format"] == "mooncake" and res["config"]["concurrency"] == 3
    assert at_least <= res["cached_tokens"] < 236
    bound = unbounded_hit_tokens(requests, 16)
    assert res["unbounded_hit_rate"] == bound.rate and bound.hit_tokens == 16 + 32 + 48 + 16
    assert res["ttft_ms"]["p90"] > 0 and res["cached_fraction"] == res["cached_tokens"] / 236


def test_bench_serve_trace_errors_name_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(SystemExit, match=rf"{path}:2: field 'input_length' is missing"):
        run(_args("http://127.0.0.1:9", "--trace", str(path)))


def check_session_replay(base: str, tmp_path, engine) -> None:
    """An agent session closed loop: a request, one subagent, the parent again (extending its first prompt); the
    parent's second prompt hits its first one's pages, and the simulator predicts the same hits. Each request
    carried its session hint: the engine pinned the answered turns and forgot both sessions at their last turns."""
    pins_before = engine.sessions.summary()
    request = {"type": "n", "out": 16, "think_time": 1.0}
    session = {
        "requests": [
            {**request, "t": 0, "in": 256, "hash_ids": [1, 2, 3, 4]},
            {
                "t": 2,
                "type": "subagent",
                "duration_ms": 3000,
                "requests": [{**request, "t": 0, "in": 64, "hash_ids": [9]}],
            },
            {**request, "t": 9, "in": 320, "hash_ids": [1, 2, 3, 4, 5]},
        ]
    }
    path = tmp_path / "session.json"
    path.write_text(json.dumps(session))
    flags = ["--trace", str(path), "--tokens-per-block", "16", "--think-scale", "0.01", "--sessions", "1"]
    calibration = ["--calibration-rounds", "1", "--calibration-shapes", "1x32->4"]
    res = run(_args(base, *flags, "--sim-kv-cache-tokens", "1024", *calibration))
    assert res["requests"] == 3 and res["failed_requests"] == 0
    assert res["warm_up"]["requests"] == 1024 // 1024 + 1 and res["warm_up"]["cache_reset"]  # the pool filled once
    assert res["prompt_tokens"] == 64 + 16 + 80 and res["cached_tokens"] == 64
    assert res["jct_s"][0] > 0 and res["simulated"]["hit_rate"] == res["hit_rate"] == 64 / 160
    calibrated = res["simulated"]["calibration"]  # one round timed, the prediction scaled by its ratio
    assert [row["label"] for row in calibrated["shapes"]] == ["1 x (32 -> 4)"] and calibrated["factor"] > 0
    assert res["simulated"]["jct_s"][0] != res["simulated"]["uncalibrated_jct_s"][0]
    pins = engine.sessions.summary()
    assert pins["session_pinned_pages"] > pins_before["session_pinned_pages"]
    assert pins["tracked_sessions"] == pins_before["tracked_sessions"]
