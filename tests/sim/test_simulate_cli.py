"""`prefixkv simulate` and `prefixkv simulate sweep` from the command line, on a hand-made five-request trace."""

from __future__ import annotations

import json

import pytest

from prefixkv.cli import main

# Mooncake format: 512-token blocks, replayed at 4 tokens a block (prompts of 8, 12, 8, 4 and 12 tokens), one
# request a second, so each is done before the next arrives: hits are the hand count below.
TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},  # nothing cached: 0
    {"timestamp": 1000, "input_length": 1536, "output_length": 3, "hash_ids": [1, 2, 3]},  # blocks 1, 2: 8
    {"timestamp": 2000, "input_length": 1024, "output_length": 3, "hash_ids": [1, 4]},  # block 1: 4
    {"timestamp": 3000, "input_length": 512, "output_length": 3, "hash_ids": [5]},  # 0
    {"timestamp": 4000, "input_length": 1536, "output_length": 3, "hash_ids": [1, 2, 3]},  # 1, 2 (not the last): 8
]
HAND_COUNT = 20
TRACE_OPTIONS = ["--tokens-per-block", "4", "--output-scale", "1", "--page-size", "4", "--quiet"]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return str(path)


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_simulate_writes_every_field_and_counts_the_hand_made_hits(trace_file, tmp_path, cache, capsys):
    out = tmp_path / cache
    argv = ["simulate", "--trace", trace_file, *TRACE_OPTIONS, "--cache", cache, "--kv-cache-tokens", "256"]
    plot = cache == "radix"  # one plot is enough to show it is drawn
    assert main(argv + ["--output-dir", str(out)] + ([] if plot else ["--no-plot"])) == 0
    printed = capsys.readouterr().out
    assert "token hit rate" in printed and "512->4 tokens/block" in printed
    results = json.loads((out / "simulate.json").read_text())
    s = results["summary"]
    assert s["hit_tokens"] == HAND_COUNT and s["prompt_tokens"] == 44 and s["served_requests"] == 5
    assert results["bounds"]["unbounded"]["hit_tokens"] == HAND_COUNT
    assert results["bounds"]["offline"]["offline_hit_tokens"] == HAND_COUNT
    assert s["of_offline_bound"] == pytest.approx(1.0) and s["unbounded_hit_rate"] == pytest.approx(20 / 44)
    for key in ("ttft_s", "queue_s"):
        assert set(s[key]) >= {"p50", "p90", "p99"} and s[key]["n"] == 5
    for key in ("output_tok_s", "requests_per_s", "evicted_pages", "preemptions", "rejected_requests", "wall_s"):
        assert key in s
    assert s["output_tokens"] == 15 and s["rejected_requests"] == 0
    assert results["scaling"].startswith("512->4 tokens/block, time x1")
    assert results["engine_config"]["prefix_cache"] == cache and results["cost_model"]["name"] == "smollm2-cpu-2t"
    assert results["engine_config"]["eviction"] == "lru" and results["options"]["eviction"] == "lru"
    assert results["options"]["kv_cache_tokens"] == 256 and results["unique_prompt_tokens"] == 20
    assert (out / "simulate.png").exists() == plot


def test_a_pool_given_as_a_fraction_of_the_unique_tokens(trace_file, tmp_path):
    argv = ["simulate", "--trace", trace_file, *TRACE_OPTIONS, "--kv-cache-fraction", "2.5", "--no-plot"]
    assert main(argv + ["--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "simulate.json").read_text())
    assert results["pool_tokens"] == 48  # 2.5 x 20 unique tokens, rounded to whole pages of 4
    assert results["summary"]["pool_pages"] == 12


def test_sweep_runs_the_grid_over_one_trace(trace_file, tmp_path, capsys):
    argv = ["simulate", "sweep", "--trace", trace_file, *TRACE_OPTIONS, "--cache", "radix"]
    argv += ["--fractions", "2.5,5", "--policies", "fcfs,k-lpm", "--evictions", "lru,cost", "--time-scales", "1,0.001"]
    argv += ["--output-dir", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "sweep.json").read_text())
    runs = results["runs"]
    assert len(runs) == 2 * 2 * 2 * 2
    assert {(r["fraction"], r["policy"], r["eviction"], r["time_scale"]) for r in runs} == {
        (f, p, e, s) for f in (2.5, 5.0) for p in ("fcfs", "k-lpm") for e in ("lru", "cost") for s in (1.0, 0.001)
    }
    assert all(r["token_hit_rate"] <= r["offline_bound_hit_rate"] + 1e-9 for r in runs)
    spaced = [r for r in runs if r["time_scale"] == 1.0 and r["fraction"] == 5.0]
    assert all(r["hit_tokens"] == HAND_COUNT for r in spaced)
    assert set(results["bounds"]["offline"]) == {"2.5", "5.0"}
    table = capsys.readouterr().out
    assert "TTFT p99" in table and "k-lpm" in table and "cost" in table
    assert (tmp_path / "sweep.png").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"name": "x"}', "missing field(s) source"),
        ("not json", "cannot read it as JSON"),
    ],
)
def test_a_bad_cost_model_file_is_a_clear_error(trace_file, tmp_path, capsys, content, message):
    bad = tmp_path / "cost.json"
    bad.write_text(content)
    argv = ["simulate", "--trace", trace_file, *TRACE_OPTIONS, "--kv-cache-tokens", "64", "--cost-model", str(bad)]
    assert main(argv + ["--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cost.json" in err and message in err
    assert not (tmp_path / "simulate.json").exists()


def test_a_missing_pool_size_or_trace_is_a_clear_error(trace_file, tmp_path, capsys):
    assert main(["simulate", "--trace", trace_file, "--output-dir", str(tmp_path)]) == 2
    assert "--kv-cache-tokens N or --kv-cache-fraction F" in capsys.readouterr().err
    assert main(["simulate", "--kv-cache-tokens", "64"]) == 2
    assert "--trace FILE is required" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "nope.jsonl"), "--kv-cache-tokens", "64"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    assert main(["simulate", "sweep", "--trace", trace_file, "--kv-cache-tokens", "64"]) == 2
    assert "pool sizes from --fractions" in capsys.readouterr().err


def test_replicas_behind_routers_from_the_command_line(trace_file, tmp_path, capsys):
    one = ["simulate", "--trace", trace_file, *TRACE_OPTIONS, "--kv-cache-tokens", "256", "--no-plot"]
    assert main(one + ["--replicas", "2", "--router", "precise", "--output-dir", str(tmp_path / "one")]) == 0
    s = json.loads((tmp_path / "one" / "simulate.json").read_text())["summary"]
    assert (s["replicas"], s["router"], s["served_requests"], sum(s["routed_per_replica"])) == (2, "precise", 5, 5)
    assert s["hit_tokens"] == HAND_COUNT  # one request at a time: the precise router finds every prefix
    assert s["pool_pages"] == 2 * 64
    sweep = ["simulate", "sweep", "--trace", trace_file, *TRACE_OPTIONS, "--fractions", "5", "--replicas", "2"]
    assert main(sweep + ["--routers", "round-robin,pooled", "--output-dir", str(tmp_path / "sweep")]) == 0
    assert (tmp_path / "sweep" / "routers.png").exists()
    runs = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]
    assert [(r["router"], r["replicas"]) for r in runs] == [("round-robin", 2), ("pooled", 2)]
    assert runs[1]["hit_tokens"] == HAND_COUNT and "pooled" in capsys.readouterr().out
    assert main(sweep + ["--routers", "random"]) == 2
    assert "--routers: unknown router 'random'" in capsys.readouterr().err


def test_router_options_reach_the_policy_that_takes_them(trace_file, tmp_path, capsys):
    one = ["simulate", "--trace", trace_file, *TRACE_OPTIONS, "--kv-cache-tokens", "256", "--no-plot"]
    one += ["--replicas", "2", "--output-dir", str(tmp_path), "--router", "precise"]
    assert main(one + ["--router-option", "decode_weight=1", "--router-option", "balance_abs_threshold=8"]) == 0
    assert main(one + ["--router-option", "max_tree_tokens=5"]) == 2
    assert "routing policy 'precise' has no option max_tree_tokens" in capsys.readouterr().err
    assert main(one + ["--router-option", "decode_weight"]) == 2
    assert "expects KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", [["--kv-offload-dir", "tier"], ["--kv-offload-host-size", "1GB"], ["--kv-events-endpoint", "tcp://*:5557"]]
)
def test_flags_of_what_the_simulator_does_not_model_are_refused(trace_file, tmp_path, capsys, flag):
    """No second KV tier and no KV events in the simulator: their flags are refused, not recorded and ignored."""
    out = tmp_path / "out"
    argv = ["simulate", "--trace", trace_file, "--kv-cache-tokens", "64", "--output-dir", str(out), *flag]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert f"{flag[0]}: the simulator models no" in capsys.readouterr().err
    assert not (tmp_path / "tier").exists() and not out.exists()
