"""Smoke tests of the benchmarks at tiny sizes: they run, write the JSON the registry promises, and report sane,
internally consistent numbers (cache hits where there must be hits, none where there must be none).

No speed assertions: timings on a shared CI machine mean nothing. Each benchmark gets the session's shared
engines through its llm_factory argument; the reference figures it prints come from common.REFERENCE, which
agrees with README.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest

from prefixkv.bench import cache_invariance, common, multi_turn, system_prompt, throughput, workloads, zero_hit

BUDGET = 64  # tokens per step: small, so requests sent together still run in several steps and can share pages
POOL = 2048  # KV tokens: every run here (at most a few hundred tokens at once) fits with room to spare


@pytest.fixture(scope="module")
def factory(llm_factory):
    """The benchmarks' llm_factory: the session's shared small-pool engines (tests/conftest.py), with BUDGET and
    a POOL-token pool (zero-hit holds three engines at once; a whole-context pool each would be 1 GiB)."""

    def make(prefix_cache="hash", **overrides):
        options = {"max_num_batched_tokens": BUDGET, "kv_cache_tokens": POOL} | overrides
        return llm_factory(prefix_cache=prefix_cache, **options)

    return make


def parse(module, argv: list[str]) -> argparse.Namespace:
    """Parse argv with the benchmark's own subcommand, exactly as `prefixkv bench` would."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench", required=True)
    module.register(sub)
    return parser.parse_args(argv)


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_throughput(factory):
    args = parse(throughput, ["throughput", "--input-len", "64", "--output-len", "2", "--num-prompts", "2"])
    res = throughput.run(args, llm_factory=factory)
    json.dumps(res)
    assert res["config"]["input_len"] == 64 and res["config"]["num_prompts"] == 2
    assert res["config"]["model"] and res["config"]["num_threads"] >= 1
    ours = res["prefixkv"]
    assert ours["prompt_tokens"] == 2 * 64 and ours["output_tokens"] == 2 * 2  # ignore_eos: exact lengths
    assert ours["cached_tokens"] == 0  # the cache was reset and random prompts share nothing
    assert finite_positive(ours["output_tok_s"]) and ours["total_tok_s"] > ours["output_tok_s"]
    assert "hf" not in res


def test_throughput_compare_hf(factory, hf_smol):
    from prefixkv.model.loader import default_model_path

    args = parse(
        throughput, ["throughput", "--input-len", "32", "--output-len", "2", "--num-prompts", "2", "--compare-hf"]
    )
    res = throughput.run(args, llm_factory=factory, hf_loader=lambda _: (hf_smol, default_model_path()))
    json.dumps(res)
    hf = res["hf"]
    assert hf["output_tokens"] == 2 * 2 and hf["gguf_weights"] == "dequantize" and "left padding" in hf["batching"]
    assert 0.0 <= hf["token_match"] <= 1.0 and "output_token_ids" not in hf
    assert finite_positive(res["ratio_output_tok_s_prefixkv_over_hf"])


def test_shared_prefix(factory):
    args = parse(
        throughput,
        [
            "shared-prefix",
            "--prefix-len",
            "64",
            "--suffix-len",
            "8",
            "--output-len",
            "2",
            "--num-prompts",
            "3",
            "--warm-prefix",
        ],
    )
    res = throughput.run_shared_prefix(args, llm_factory=factory)
    json.dumps(res)
    assert set(res["modes"]) == {"off", "hash"} and res["config"]["prefix_state"] == "warm"
    assert res["modes"]["off"]["cached_tokens"] == 0
    assert res["modes"]["hash"]["cached_tokens"] == 3 * 64  # every request hits the whole (block-aligned) prefix
    assert res["modes"]["hash"]["output_tokens"] == 3 * 2
    assert finite_positive(res["ratio_output_tok_s_on_over_off"])
    assert res["reference"]["output_tok_s_on"] == common.REFERENCE["shared_prefix_output_tok_s_on"]


def test_system_prompt(factory):
    args = parse(system_prompt, ["system-prompt", "--system-tokens", "64", "--question-tokens", "8", "--repeats", "2"])
    res = system_prompt.run(args, llm_factory=factory)
    json.dumps(res)
    on, off = res["ttft"]["hash"], res["ttft"]["off"]
    assert on["cold_cached_tokens"] == [0, 0]  # each repetition starts from an empty cache
    assert on["warm_cached_tokens"] == [64, 64]  # the whole system prompt (4 full blocks) hits
    assert off["warm_cached_tokens"] == [0, 0]
    for t in (on, off):
        assert finite_positive(t["cold_s"]) and finite_positive(t["warm_s"])
    assert finite_positive(res["speedup_warm_vs_cold_on"]) and finite_positive(res["speedup_warm_on_vs_off"])
    assert res["config"]["system_tokens"] == 64


def test_multi_turn(factory):
    args = parse(
        multi_turn, ["multi-turn", "--turns", "3", "--turn-tokens", "20", "--output-len", "2", "--repeats", "1"]
    )
    res = multi_turn.run(args, llm_factory=factory)
    json.dumps(res)
    turns = res["turns"]
    assert [t["prompt_tokens"] for t in turns] == [20, 42, 64]  # history + answer + new message
    assert turns[0]["cached_hash"] == 0 and turns[-1]["cached_hash"] > 0
    assert all(t["cached_off"] == 0 for t in turns)
    assert all(finite_positive(t["ttft_hash_s"]) and finite_positive(t["ttft_off_s"]) for t in turns)
    assert finite_positive(res["ratio_last_over_first_on"])


def test_zero_hit(factory):
    args = parse(
        zero_hit,
        [
            "zero-hit",
            "--input-len",
            "32",
            "--output-len",
            "2",
            "--num-prompts",
            "2",
            "--repeats",
            "2",
            "--hash-blocks",
            "16",
        ],
    )
    res = zero_hit.run(args, llm_factory=factory)
    json.dumps(res)
    assert set(res["modes"]) == {"off", "hash", "radix"}
    assert res["modes"]["off"]["cached_tokens"] == 0 and res["modes"]["hash"]["cached_tokens"] == 0
    assert len(res["modes"]["radix"]["output_tok_s_runs"]) == 2
    assert set(res["ratio_output_tok_s_on_over_off"]) == {"hash", "radix"}
    assert set(res["engine_overhead_added_share"]) == {"hash", "radix"}
    assert all(0 < m["outside_model_s"] < m["elapsed_s"] for m in res["modes"].values())
    assert set(res["hash_us_per_block"]) == {"sha256", "xxhash"}
    assert all(finite_positive(us) for c in res["hash_us_per_block"].values() for us in c.values())


def test_cache_invariance(factory):
    """The flip-count benchmark at a tiny size: every warm run hits, every count is reported per cache and phase."""
    args = parse(
        cache_invariance,
        "cache-invariance --num-short 2 --num-system 2 --num-turns 2 --output-len 2 --alone 2 --caches hash".split(),
    )
    res = cache_invariance.run(args, llm_factory=factory)
    json.dumps(res)
    assert res["config"]["num_prompts"] == 6 and res["alone_vs_batch"]["prompts"]
    assert set(res["caches"]) == {"hash"}
    for entry in res["caches"].values():
        assert entry["full_hit"]["prompts_hit"] == 6 and entry["partial_hit"]["prompts_hit"] >= 4
        assert all(0 <= entry[phase]["flips"] <= 6 for phase in ("partial_hit", "full_hit"))
        assert all(0 <= entry[phase]["logprob_drifts"] <= 6 for phase in ("partial_hit", "full_hit"))
    assert res["distinct_tokens"]["min"] >= 1 and res["config"]["logprobs"] == 5


def test_cli_writes_json_and_plot(factory, tmp_path, monkeypatch):
    """Through `prefixkv bench`, with the module's engines patched in: the registry writes NAME.json and a plot."""
    from prefixkv.cli import main

    monkeypatch.setattr(common, "make_llm", lambda args, prefix_cache=None, **kw: factory(prefix_cache, **kw))
    argv = [
        "bench",
        "system-prompt",
        "--system-tokens",
        "32",
        "--question-tokens",
        "4",
        "--repeats",
        "1",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    res = json.loads((tmp_path / "system-prompt.json").read_text())
    assert res["benchmark"] == "system-prompt" and res["ttft"]["hash"]["warm_cached_tokens"] == [32]
    assert (tmp_path / "system-prompt.png").stat().st_size > 0


def test_plots_render(tmp_path):
    """Every plot() draws from a hand-made result, so a plotting bug cannot hide behind a slow benchmark."""
    cfg = {
        "dtype": "float32",
        "num_threads": 2,
        "system_tokens": 8,
        "question_tokens": 2,
        "turn_tokens": 4,
        "output_len": 2,
    }
    ref = {
        "label": common.REFERENCE_LABEL,
        "cold_s": 0.98,
        "warm_s": 0.055,
        "output_tok_s_on": 426.0,
        "output_tok_s_off": 65.0,
        "unrelated_512_output_tok_s": 150.0,
    }
    cases = {
        system_prompt: {
            "config": cfg,
            "reference": ref,
            "ttft": {"hash": {"cold_s": 0.5, "warm_s": 0.02}, "off": {"cold_s": 0.5, "warm_s": 0.5}},
        },
        multi_turn: {
            "config": cfg,
            "modes": ["hash", "off"],
            "turns": [{"turn": i, "ttft_hash_s": 0.1, "ttft_off_s": 0.1 * i} for i in (1, 2, 3)],
        },
        zero_hit: {
            "config": cfg,
            "modes": {m: {"output_tok_s": 100.0, "output_tok_s_runs": [99.0, 101.0]} for m in ("off", "hash", "radix")},
        },
        throughput: {
            "config": cfg,
            "reference": ref,
            "prefixkv": {"output_tok_s": 120.0},
            "hf": {"output_tok_s": 60.0},
        },
    }
    for i, (module, results) in enumerate(cases.items()):
        png = tmp_path / f"{i}.png"
        module.plot(results, str(png))
        assert png.stat().st_size > 0
    png = tmp_path / "shared.png"
    throughput.plot(
        {"config": cfg, "reference": ref, "modes": {"off": {"output_tok_s": 60.0}, "hash": {"output_tok_s": 300.0}}},
        str(png),
    )
    assert png.stat().st_size > 0


def test_workload_helpers():
    sampler = workloads.TokenSampler(vocab_size=50, special_ids=range(10), seed=1)
    prompts = workloads.shared_prefix_prompts(sampler, 3, 8, 4)
    assert all(len(p) == 12 and p[:8] == prompts[0][:8] for p in prompts)
    assert all(10 <= t < 50 for p in prompts for t in p)
    again = workloads.TokenSampler(vocab_size=50, special_ids=range(10), seed=1)
    assert workloads.shared_prefix_prompts(again, 3, 8, 4) == prompts  # seeded: reproducible
    assert workloads.percentile([1, 2, 3, 4], 50) == 2.5 and workloads.percentile([5], 99) == 5
    assert workloads.summarize([1.0, 3.0])["median"] == 2.0
    assert math.isnan(workloads.ratio(1.0, 0.0))


def test_reference_figures_agree_with_the_docs():
    """The vLLM reference figures live in one place, common.REFERENCE; every one README or docs/benchmarks.md
    quotes is one of them."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text() + (root / "docs" / "benchmarks.md").read_text()
    quoted = [float(x) for m in re.finditer(r"reference: ([\d.]+)(?: / ([\d.]+))?", text) for x in m.groups() if x]
    assert quoted, "the docs quote no reference figure"
    assert set(quoted) <= set(common.REFERENCE.values()), quoted
