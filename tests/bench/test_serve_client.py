"""The HTTP benchmark client against a real server on the default model: both workloads, tiny sizes."""

from __future__ import annotations

import argparse

from prefixkv.bench.serve_client import _dist, add_arguments, plot, run
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
    engine = new_engine()
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

        bad = run(_args(base, "--num-requests", "1", "--model", "nope"))
        assert bad["num_errors"] == 1 and "404" in bad["errors"][0]


def test_percentiles_nearest_rank():
    d = _dist([i / 1000 for i in range(1, 101)])
    assert d["p50"] == 50 and d["p99"] == 99 and abs(d["mean"] - 50.5) < 1e-9
