"""The comparison script's own logic (scripts/compare_vllm): prompts, the offline rows on the real engine, the
ratio and table maths, the Prometheus parsing and the command line. Nothing here runs vLLM or depends on speed.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from compare_vllm import report  # noqa: E402
from compare_vllm.__main__ import parse_args  # noqa: E402
from compare_vllm.offline_rows import run_offline_rows  # noqa: E402
from compare_vllm.servers import parse_prometheus, prometheus_labels  # noqa: E402
from compare_vllm.side_prefixkv import generate_fn  # noqa: E402
from compare_vllm.workloads import END_ID, FIRST_ID, FULL, QUICK, OfflinePrompts, Sizes  # noqa: E402

TINY = Sizes(
    system_tokens=64,
    question_tokens=8,
    warm_repeats=3,
    shared_prefix_tokens=48,
    shared_suffix_tokens=8,
    num_prompts=3,
    output_tokens=3,
    zero_hit_tokens=24,
    max_model_len=512,
    max_num_batched_tokens=64,
)


def test_prompts_are_the_issue_sizes_and_reproducible():
    a, b = OfflinePrompts.build(FULL, seed=0), OfflinePrompts.build(FULL, seed=0)
    assert a == b  # both venvs build the same ids from the same seed
    assert a != OfflinePrompts.build(FULL, seed=1)
    assert len(a.system) == 2048 and [len(q) for q in a.questions] == [50] * 4
    assert len(a.shared) == 32 and all(len(p) == 1024 + 50 and p[:1024] == a.shared[0][:1024] for p in a.shared)
    assert len({tuple(p[1024:]) for p in a.shared}) == 32  # every suffix its own
    assert len(a.zero_hit) == 32 and all(len(p) == 512 for p in a.zero_hit)
    assert len({p[0] for p in a.zero_hit}) > 16  # unrelated: no common first page
    assert len(a.warmup_long) == 2048 + 50 and a.warmup_long[:64] != a.system[:64]
    every = [t for p in [a.system, *a.questions, *a.shared, *a.zero_hit] for t in p]
    assert FIRST_ID <= min(every) and max(every) < END_ID


def test_offline_rows_on_the_real_engine(llm_factory):
    """The rows count what they claim on prefixkv itself: warm requests hit the system prompt, the cold one and the
    zero-hit ones do not, and every prompt produced its output tokens."""
    llm = llm_factory(prefix_cache="hash", max_num_batched_tokens=TINY.max_num_batched_tokens)
    llm.reset_prefix_cache()
    rows = run_offline_rows(generate_fn(llm), TINY, seed=0)
    d = rows["detail"]
    page = llm.config.tokens_per_page
    assert d["cold_cached_tokens"] == 0
    assert d["warm_cached_tokens"] == [TINY.system_tokens // page * page] * TINY.warm_repeats
    assert d["shared_prefix_output_tokens"] == d["zero_hit_output_tokens"] == TINY.num_prompts * TINY.output_tokens
    assert d["zero_hit_cached_tokens"] == 0
    assert rows["warm_ttft_s"] == sorted(d["warm_ttft_samples_s"])[1]
    for key in ("cold_ttft_s", "warm_ttft_s", "shared_prefix_tok_s", "zero_hit_tok_s"):
        assert rows[key] > 0 and math.isfinite(rows[key])


def _row(higher_is_better: bool) -> report.Row:
    return report.Row("x", "x", "u", higher_is_better, "offline")


def test_ratio_is_above_one_when_prefixkv_is_ahead():
    assert report.ratio(_row(True), vllm=100.0, prefixkv=150.0) == 1.5  # rates: prefixkv / vLLM
    assert report.ratio(_row(False), vllm=1.0, prefixkv=0.5) == 2.0  # times: vLLM / prefixkv
    for bad in (0.0, math.nan, math.inf, -1.0):
        assert math.isnan(report.ratio(_row(True), vllm=bad, prefixkv=1.0))
        assert math.isnan(report.ratio(_row(False), vllm=1.0, prefixkv=bad))


def test_summary_takes_medians_then_their_ratio():
    rows = report.rows_for(FULL)
    per_round = {
        "vllm": [
            {"cold_ttft_s": 1.0, "zero_hit_tok_s": 100.0},
            {"cold_ttft_s": 3.0, "zero_hit_tok_s": 120.0},
            {"cold_ttft_s": 2.0, "zero_hit_tok_s": 140.0},
        ],
        "prefixkv": [
            {"cold_ttft_s": 4.0, "zero_hit_tok_s": 60.0},
            {"cold_ttft_s": 1.0, "zero_hit_tok_s": 240.0},
            {"cold_ttft_s": 1.0, "zero_hit_tok_s": 90.0},
        ],
    }
    summary = {s["key"]: s for s in report.summarize(rows, per_round)}
    assert set(summary) == {"cold_ttft_s", "zero_hit_tok_s"}  # rows no round measured are left out
    cold, zero = summary["cold_ttft_s"], summary["zero_hit_tok_s"]
    assert cold["median"] == {"vllm": 2.0, "prefixkv": 1.0} and cold["ratio"] == 2.0
    assert cold["per_round_ratio"] == [0.25, 3.0, 2.0]
    assert zero["median"] == {"vllm": 120.0, "prefixkv": 90.0} and zero["ratio"] == 0.75
    table = report.format_table(list(summary.values()))
    assert "| cold TTFT (2048 + 50 tokens, 1 out) | s | 2.00 | 1.00 | 2.00x | 0.250, 3.00, 2.00 |" in table
    assert "0.75x" in table and table.count("\n") == 3


def test_every_row_names_its_sizes():
    labels = [r.label for r in report.rows_for(FULL)]
    assert any("32 x (1024 shared + 50), 32 out" in label for label in labels)
    assert any("32 x 512 unrelated, 32 out" in label for label in labels)
    assert {r.key for r in report.rows_for(QUICK)} == {r.key for r in report.rows_for(FULL)}


def test_prometheus_counters_and_vllm_cache_config():
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of num of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 31744.0',
            "prefixkv:prefix_cache_hits_total 512.0",
            'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True"} 1.0',
        ]
    )
    counters = parse_prometheus(text)
    assert counters["vllm:prefix_cache_hits_total"] == 31744.0
    assert counters["prefixkv:prefix_cache_hits_total"] == 512.0
    labels = prometheus_labels(text, "vllm:cache_config_info")
    assert labels == {"block_size": "128", "cache_dtype": "auto", "enable_prefix_caching": "True"}
    assert prometheus_labels(text, "vllm:missing") == {}


def test_command_line():
    args = parse_args([])
    assert args.rounds == 3 and args.row_groups == ["offline", "serve"] and not args.quick
    assert args.output_dir.endswith(os.path.join("docs", "benchmarks", "vllm_side_by_side"))
    quick = parse_args(["--quick", "--rows", "serve"])
    assert quick.rounds == 1 and quick.row_groups == ["serve"] and "bench_results" in quick.output_dir
    assert parse_args(["--quick", "--rounds", "2"]).rounds == 2
    for bad in (["--rows", "offline,gpu"], ["--rows", ""], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
