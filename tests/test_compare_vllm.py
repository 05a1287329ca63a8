"""The comparison script's own logic (scripts/compare_vllm): prompts, the offline rows on the real engine, the
ratio, bound and table maths, the Prometheus parsing, the preloads, the output folders and the command line.
Nothing here runs vLLM or depends on speed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from compare_vllm import limits, report  # noqa: E402
from compare_vllm.__main__ import (  # noqa: E402
    PreloadMissing,
    cpu_family,
    find_iomp,
    find_tcmalloc,
    header,
    parse_args,
    preloads,
    served_rows,
)
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


def test_summary_takes_the_median_of_the_per_round_ratios():
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
    # not the ratio of the medians (90 / 120 = 0.75): the median of 0.6, 2.0 and 90 / 140
    assert zero["median"] == {"vllm": 120.0, "prefixkv": 90.0} and zero["ratio"] == pytest.approx(90 / 140)
    assert zero["paired"]["ahead"] == 1 and zero["paired"]["behind"] == 2 and zero["paired"]["kind"] == "tie"
    table = report.format_table(list(summary.values()))
    row = "| cold TTFT (2048 + 50 tokens, 1 out) | s | 2.00 | 1.00 | 2.00x | 0.250, 3.00, 2.00 | a tie within the noise"
    assert row in table
    assert "0.64x" in table and table.count("\n") == 3
    assert math.isnan(cold["bound"]) and all(math.isnan(v) for v in cold["times_bound"].values())


def test_summary_and_table_show_the_distance_to_the_bound():
    rows = report.rows_for(FULL)
    per_round = {"vllm": [{"cold_ttft_s": 4.0, "zero_hit_tok_s": 50.0}], "prefixkv": [{"cold_ttft_s": 2.0}]}
    bounds = {"cold_ttft_s": {"bound": 0.5}, "zero_hit_tok_s": {"bound": 200.0}}
    summary = {s["key"]: s for s in report.summarize(rows, per_round, bounds)}
    cold, zero = summary["cold_ttft_s"], summary["zero_hit_tok_s"]
    assert cold["bound"] == 0.5 and cold["times_bound"] == {"vllm": 8.0, "prefixkv": 4.0}  # times: value / bound
    assert zero["times_bound"]["vllm"] == 4.0 and math.isnan(zero["times_bound"]["prefixkv"])  # rates: bound / value
    table = report.format_table(list(summary.values()))
    assert "| s | 4.00 | 2.00 | 2.00x | 2.00 | ahead in its only round (too few to test) | 0.500 | 8.00x |" in table
    assert "| 200 | 4.00x | - |" in table


def test_every_row_names_its_sizes():
    labels = [r.label for r in report.rows_for(FULL)]
    assert any("32 x (1024 shared + 50), 32 out" in label for label in labels)
    assert any("32 x 512 unrelated, 32 out" in label for label in labels)
    assert any("4 prefixes x (1024 + 64), 32 prompts, 32 out" in label for label in labels)
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
    from prefixkv.model import cpu_features

    args = parse_args([])
    assert args.rounds == 3 and args.row_groups == ["offline", "serve"] and not args.quick
    family = cpu_family(cpu_features.describe())
    assert args.output_dir.endswith(os.path.join("docs", "benchmarks", "vllm_side_by_side", family))
    assert args.prefixkv_preload == "tcmalloc" and not args.no_preload
    quick = parse_args(["--quick", "--rows", "serve"])
    assert quick.rounds == 1 and quick.row_groups == ["serve"]
    assert quick.output_dir.endswith(os.path.join("bench_results", "vllm_side_by_side_quick"))
    assert parse_args(["--quick", "--rounds", "2"]).rounds == 2
    assert parse_args(["--prefixkv-preload", "none"]).prefixkv_preload == "none"
    assert parse_args(["--no-preload"]).no_preload
    bad_args = (
        ["--rows", "offline,gpu"],
        ["--rows", ""],
        ["--rounds", "0"],
        ["--prefixkv-preload", "jemalloc"],
        ["--no-preload", "--prefixkv-preload", "none"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_one_folder_per_cpu_family():
    def cpu(vendor, *flags):
        return {"vendor": vendor, "flags": list(flags)}

    assert cpu_family(cpu("intel", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")) == "intel_xeon_amx"
    assert cpu_family(cpu("intel", "avx512f", "avx512_bf16")) == "intel_xeon"
    assert cpu_family(cpu("amd", "avx512f", "avx512_bf16")) == "amd_epyc"
    assert cpu_family(cpu("amd")) == "amd_epyc_avx2"  # Zen 3: AVX2 only
    assert cpu_family(cpu("other")) == "other"
    kept = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks")
    assert os.path.exists(os.path.join(kept, "vllm_side_by_side", "amd_epyc", "compare_vllm.json"))


def test_preloads(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    with monkeypatch.context() as m:  # nor does ldconfig know one
        m.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=""))
        with pytest.raises(PreloadMissing, match="apt-get install -y libtcmalloc-minimal4"):
            find_tcmalloc((str(lib),))
    (lib / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc((str(lib),)) == str(lib / "libtcmalloc_minimal.so.4")

    venv = tmp_path / "venv"
    with pytest.raises(PreloadMissing, match="intel-openmp"):
        find_iomp(str(venv))
    nested = venv / "lib" / "python3.11" / "site-packages" / "intel_openmp"
    nested.mkdir(parents=True)
    (nested / "libiomp5.so").write_bytes(b"")
    assert find_iomp(str(venv)) == str(nested / "libiomp5.so")  # anywhere in the venv ...
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    assert find_iomp(str(venv)) == str(venv / "lib" / "libiomp5.so")  # ... lib/ first

    assert preloads(parse_args(["--no-preload"]), str(venv)) == {"vllm": "", "prefixkv": ""}
    try:
        tcmalloc = find_tcmalloc()
    except PreloadMissing:
        pytest.skip("no libtcmalloc_minimal.so.4 on this machine")
    assert preloads(parse_args([]), str(venv)) == {
        "vllm": f"{tcmalloc}:{venv}/lib/libiomp5.so",  # the order vLLM's CPU install docs give
        "prefixkv": tcmalloc,  # the same allocator; never libiomp5 (prefixkv's torch runs GNU OpenMP)
    }
    assert preloads(parse_args(["--prefixkv-preload", "none"]), str(venv))["prefixkv"] == ""


def test_header_names_preloads_cpu_and_limits():
    config = {
        "vllm": {"versions": {"vllm": "0.32.0", "torch": "2.13.0+cpu"}, "offline_engine": {"block_size": 128}},
        "prefixkv": {"versions": {"prefixkv": "0.1.0", "torch": "2.13.0+cpu"}, "offline_engine": {"page_size": 16}},
        "ld_preload": {"vllm": "/t.so.4:/v/lib/libiomp5.so", "prefixkv": "/t.so.4", "no_preload": False},
        "machine": {"cpu": {"model": "AMD EPYC", "flags": ["avx512f", "avx512_bf16"]}, "cpu_count": 2},
        "threads": 2,
        "rounds": 3,
        "limits": {"bandwidth_bytes_s": 2e10, "gemm_flops_s": 4e11, "gemm_path": "avx512_bf16", "gemm_rows": 2048},
    }
    text = header(config)
    assert "LD_PRELOAD=/t.so.4:/v/lib/libiomp5.so |" in text and "LD_PRELOAD=/t.so.4 |" in text
    assert "AMD EPYC x 2 (avx512f, avx512_bf16)" in text
    assert "20.0 GB/s memory, 400 GFLOP/s bf16 GEMM (avx512_bf16, M=2048)" in text
    config["ld_preload"] = {"vllm": "", "prefixkv": "", "no_preload": True}
    assert header(config).count("LD_PRELOAD=(none: --no-preload)") == 2


def test_served_rows_include_the_prefix_repetition_row():
    rows = {r.name: r for r in served_rows(FULL)}
    assert list(rows) == ["serve_shared", "serve_zero_hit", "serve_prefixes"]
    args = rows["serve_prefixes"].dataset_args
    assert args[:2] == ["--dataset-name", "prefix_repetition"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--prefix-repetition-prefix-len"] == "1024" and flags["--prefix-repetition-suffix-len"] == "64"
    assert flags["--prefix-repetition-num-prefixes"] == "4" and flags["--prefix-repetition-output-len"] == "32"
    assert rows["serve_prefixes"].num_prompts == 32
    assert rows["serve_shared"].dataset_args[:4] == ["--dataset-name", "random", "--random-prefix-len", "1024"]
    # QUICK stays tiny; the client sends num_prompts // num_prefixes per prefix
    quick = {r.name: r for r in served_rows(QUICK)}["serve_prefixes"]
    assert quick.num_prompts == QUICK.num_prompts // QUICK.repeated_prefixes * QUICK.repeated_prefixes
    assert QUICK.repeated_prefix_tokens + QUICK.repeated_suffix_tokens <= QUICK.max_num_batched_tokens
    odd = Sizes(num_prompts=10, repeated_prefixes=4)
    assert {r.name: r for r in served_rows(odd)}["serve_prefixes"].num_prompts == 8


def test_model_sizes_of_the_bounds():
    assert limits.LAYER_PARAMS == 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) == 106_168_320
    assert limits.HEAD_PARAMS == 49152 * 576
    assert limits.WEIGHT_BYTES == 2 * (limits.LAYER_PARAMS + limits.HEAD_PARAMS) == 268_959_744


def test_row_work_counts_tokens_logits_and_steps():
    work = limits.row_work(FULL)
    assert set(work) == {r.key for r in report.rows_for(FULL)}
    assert work["cold_ttft_s"] == limits.Work(tokens=2098, logits=1, steps=2)  # 2098 tokens, 2048 per pass
    assert work["warm_ttft_s"] == limits.Work(tokens=50, logits=1, steps=1)  # the whole system prompt cached
    # 1024 shared once + 32 suffixes of 50, then 31 more tokens each; 32 passes (one per output token)
    assert work["shared_prefix_tok_s"] == limits.Work(1024 + 32 * 50 + 32 * 31, 32 * 32, 32, 32 * 32)
    assert work["zero_hit_tok_s"] == limits.Work(32 * 512 + 32 * 31, 32 * 32, 32, 32 * 32)  # 9 full passes suffice
    # served: at most 16 sequences per pass, so 32 x 32 output tokens need 64 passes
    assert work["serve_shared_tok_s"].steps == 64 and work["serve_zero_hit_tok_s"].steps == 64
    # the median of 32 TTFTs waits for 16 prompts' prefill: the shared prefix once, 16 suffixes
    assert work["serve_shared_ttft_ms"] == limits.Work(1024 + 16 * 50, 16, 1)
    assert work["serve_zero_hit_ttft_ms"] == limits.Work(16 * 512, 16, 4)
    # 4 prefixes of 1024 with 8 prompts each; the 16 first prompts span at least 2 prefixes
    assert work["serve_prefixes_tok_s"] == limits.Work(4 * 1024 + 32 * 64 + 32 * 31, 1024, 64, 1024)
    assert work["serve_prefixes_ttft_ms"] == limits.Work(2 * 1024 + 16 * 64, 16, 2)  # 3072 tokens: 2 passes
    # fewer prompts than prefixes: vLLM's client refuses the row, and it has no bound
    assert "serve_prefixes_tok_s" not in limits.row_work(Sizes(num_prompts=3, repeated_prefixes=4))


def test_bounds_in_each_rows_unit():
    measured = {"bandwidth_bytes_s": 1e10, "gemm_flops_s": 1e11}
    bounds = limits.row_bounds(FULL, measured)
    cold = bounds["cold_ttft_s"]
    compute = (2 * limits.LAYER_PARAMS * 2098 + 2 * limits.HEAD_PARAMS) / 1e11
    assert cold["compute_s"] == pytest.approx(compute) and cold["memory_s"] == pytest.approx(2 * 0.0268959744)
    assert cold["bound"] == cold["bound_s"] == pytest.approx(compute)  # prefill: compute-bound
    warm = bounds["warm_ttft_s"]
    assert warm["bound"] == max(warm["compute_s"], warm["memory_s"])
    shared = bounds["shared_prefix_tok_s"]
    assert shared["bound"] == pytest.approx(1024 / shared["bound_s"])  # a rate: output tokens over the least time
    ttft = bounds["serve_shared_ttft_ms"]
    assert ttft["bound"] == pytest.approx(1e3 * ttft["bound_s"])
    # decode-heavy: one token per pass over 64 passes, memory-bound at this bandwidth
    one_token = limits.row_bounds(
        Sizes(num_prompts=1, output_tokens=64, zero_hit_tokens=8), {"bandwidth_bytes_s": 1e10, "gemm_flops_s": 1e12}
    )["zero_hit_tok_s"]
    assert one_token["bound_s"] == one_token["memory_s"] == pytest.approx(64 * limits.WEIGHT_BYTES / 1e10)
    # a faster machine never raises the least time
    faster = limits.row_bounds(FULL, {"bandwidth_bytes_s": 2e10, "gemm_flops_s": 2e11})
    assert all(faster[k]["bound_s"] <= bounds[k]["bound_s"] for k in bounds)


def test_times_bound_is_at_least_one_for_a_sound_bound():
    assert limits.times_bound(False, value=3.0, bound=1.5) == 2.0  # a time: value / bound
    assert limits.times_bound(True, value=50.0, bound=200.0) == 4.0  # a rate: bound / value
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert math.isnan(limits.times_bound(True, bad, 1.0)) and math.isnan(limits.times_bound(False, 1.0, bad))


def test_vllm_runs_in_each_configuration_that_can_suit_it():
    from compare_vllm.variants import choose

    with_bf16, without = {"flags": ["avx512f", "avx512_bf16"]}, {"flags": []}  # Zen 4; Zen 3 (AVX2 only)
    both = ("offline", "serve")

    def names(requested, cpu, threads=2, groups=both):
        return [(v.name, v.dtype, v.row_groups) for v in choose(requested, cpu, threads, list(groups))]

    assert names("auto", with_bf16) == [("vllm", "bfloat16", both), ("vllm_reserved", "bfloat16", ("serve",))]
    assert names("auto", without) == [
        ("vllm", "bfloat16", both),
        ("vllm_fp32", "float32", both),
        ("vllm_reserved", "bfloat16", ("serve",)),
        ("vllm_fp32_reserved", "float32", ("serve",)),
    ]
    assert names("auto", with_bf16, threads=1) == [("vllm", "bfloat16", both)]  # no core to spare
    assert names("auto", without, groups=("offline",)) == [
        ("vllm", "bfloat16", ("offline",)),
        ("vllm_fp32", "float32", ("offline",)),
    ]
    assert names("none", without) == [("vllm", "bfloat16", both)]
    assert names("vllm_fp32", with_bf16) == [("vllm", "bfloat16", both), ("vllm_fp32", "float32", both)]
    assert names("vllm_reserved", with_bf16, groups=("offline",)) == [("vllm", "bfloat16", ("offline",))]
    with pytest.raises(ValueError, match="unknown vLLM configuration"):
        choose("vllm_fp16", with_bf16, 2, list(both))
    with pytest.raises(ValueError, match="needs --threads 2"):
        choose("vllm_reserved", with_bf16, 1, list(both))
    reserved = choose("vllm_reserved", with_bf16, 4, list(both))[1]
    assert reserved.env(4) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-2"}
    with pytest.raises(SystemExit):
        parse_args(["--vllm-configs", "vllm_bf8"])


def test_each_configuration_gets_its_dtype_placement_and_turn(tmp_path):
    from compare_vllm.__main__ import Runner, run_round

    args = parse_args(["--no-preload", "--output-dir", str(tmp_path), "--vllm-configs", "vllm_fp32,vllm_fp32_reserved"])
    runner = Runner(args, TINY)
    runner.prepare()
    assert runner.engines(0) == ["vllm", "vllm_fp32", "vllm_fp32_reserved", "prefixkv"]
    assert runner.engines(1) == ["prefixkv", "vllm_fp32_reserved", "vllm_fp32", "vllm"]
    assert runner.env["vllm"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert runner.env["vllm_fp32_reserved"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    assert runner.env["vllm_fp32_reserved"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    served = runner.server("vllm_fp32_reserved", 0)
    assert " --dtype float32 " in " ".join(served.argv) and served.env is runner.env["vllm_fp32_reserved"]
    assert " --dtype bfloat16 " in " ".join(runner.server("prefixkv", 0).argv)

    ran = []

    def fake_run(engine, argv, log_name, what):  # what the part would have written
        ran.append((engine, argv))
        with open(argv[argv.index("--out") + 1], "w") as f:
            value = {"vllm": 2.0, "vllm_fp32": 1.5, "prefixkv": 1.0}[engine]
            json.dump({"rows": {"cold_ttft_s": value, "detail": {}}, "engine": {}}, f)
        return log_name

    runner._run = fake_run
    args.row_groups = ["offline"]
    config: dict = {}
    record = run_round(runner, args, 1, config)
    assert record["order"] == ["prefixkv", "vllm_fp32_reserved", "vllm_fp32", "vllm"]
    assert [e for e, _ in ran] == ["prefixkv", "vllm_fp32", "vllm"]  # the reserved core serves only
    fp32_argv = dict(ran)["vllm_fp32"]
    assert fp32_argv[fp32_argv.index("--dtype") + 1] == "float32"
    per_round = {e: [record.get(e, {}).get("rows", {})] for e in runner.engines(0)}
    (cold,) = report.summarize([r for r in report.rows_for(TINY) if r.key == "cold_ttft_s"], per_round)
    assert cold["vllm_variant"] == "vllm_fp32" and cold["median"]["vllm"] == 1.5 and cold["ratio"] == 1.5


def _shape_config(tmp_path, name: str = "qwen3-0.6b") -> str:
    """A checkpoint directory as far as --model reads it when parsed: config.json only (no weights)."""
    from prefixkv.model.shapes import SHAPES

    cfg = {**SHAPES[name].hf_config(small=True, vocab_size=49152), "prefixkv_shape": {"name": name, "small": True}}
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_model_flag_names_the_shape_and_keeps_its_results_apart(tmp_path):
    from compare_vllm.__main__ import Runner, bound_model_size, describe_model

    ckpt = _shape_config(tmp_path)
    args = parse_args(["--quick", "--model", ckpt, "--no-preload"])
    assert args.model == ckpt and args.model_shape["shape"] == "qwen3-0.6b-small"
    assert args.model_shape["head_dim"] == 128 and args.model_shape["qk_norm"]
    # beside, never over, the default model's results
    assert args.output_dir == os.path.join(parse_args(["--quick"]).output_dir, "qwen3-0.6b-small")
    assert parse_args(["--model", ckpt, "--output-dir", str(tmp_path)]).output_dir == str(tmp_path)
    assert parse_args([]).model is None and parse_args([]).model_shape is None
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path / "missing")])

    args.output_dir = str(tmp_path / "out")
    runner = Runner(args, TINY)
    runner.prepare()
    assert runner.model_dir == ckpt  # vLLM's side, its server and its client's tokenizer
    for engine in ("vllm", "prefixkv"):
        argv = runner.server(engine, 0).argv
        assert ckpt in argv and (engine == "vllm" or argv[argv.index("--model") + 1] == ckpt)
    ran = []

    def fake_run(engine, argv, log_name, what):
        ran.append(argv)
        with open(argv[argv.index("--out") + 1], "w") as f:
            json.dump({"rows": {"detail": {}}, "engine": {}}, f)
        return log_name

    runner._run = fake_run
    runner.offline("prefixkv", 0)
    runner.offline("vllm", 0)
    assert ran[0][ran[0].index("--model") + 1] == ckpt and ran[1][ran[1].index("--model-dir") + 1] == ckpt

    # the bounds count this model's weights: 2 layers of hidden 256, 4 heads and 2 kv heads of 128
    size = bound_model_size(ckpt)
    assert size.layer_params == 2 * (256 * (512 + 2 * 256) + 512 * 256 + 3 * 512 * 256)
    assert size.head_params == 49152 * 256 and bound_model_size(None) == limits.SMOLLM2
    text = describe_model(args.model_shape)
    assert text.startswith("model qwen3-0.6b-small: qwen3, 2 layers") and "Qwen/Qwen3-0.6B" in text


def test_smollm2_sizes_from_its_config_are_the_bounds_constants():
    smollm2 = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
    }
    assert limits.ModelSize.from_hf_config(smollm2) == limits.SMOLLM2
    assert limits.SMOLLM2.weight_bytes == limits.WEIGHT_BYTES
