"""`prefixkv bench decode` at a tiny size on the session's shared engine: the JSON's shape and its invariants
(the split's parts are non-negative and add up to the measured step, the floor is positive, every stream count is
there). No speed assertions: timings on a shared CI machine mean nothing."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from prefixkv.bench import decode
from prefixkv.model import native


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    decode.register(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_defaults_are_the_issue_workload():
    args = parse(["decode"])
    assert (args.input_len, args.output_len, args.streams, args.repeats) == (50, 256, "1,4,16", 3)
    assert args.dtype == "bfloat16"


def test_decode_json_shape_and_invariants(llm_factory, tmp_path):
    args = parse(
        "decode --input-len 8 --output-len 4 --streams 1,3 --repeats 1 --bandwidth-mib 4 --bandwidth-repeats 1".split()
    )
    llm = llm_factory(prefix_cache="hash")
    res = decode.run(args, llm_factory=lambda **_: llm)
    json.dumps(res)
    assert res["cpu"]["model"] and res["kernels"] and res["config"]["streams"] == [1, 3]
    assert set(res["speed"]) == set(res["split"]) == set(res["measured_over_floor"]) == {"1", "3"}
    for n, s in res["speed"].items():
        assert s["streams"] == int(n) and s["output_tokens"] == int(n) * 4 and s["decode_tokens"] == int(n) * 3
        assert positive(s["decode_tok_s"]) and positive(s["decode_step_ms"]) and positive(s["ttft_s"])
        assert len(s["decode_tok_s_runs"]) == 1
    for sp in res["split"].values():
        assert sp["decode_steps"] == 3  # 4 tokens: the prefill's, then 3 decode steps
        assert set(sp["parts_ms"]) == set(decode.PART_KEYS) == set(res["parts"])
        assert all(v >= 0 for v in sp["parts_ms"].values())
        assert sp["parts_ms"]["qkv_proj"] > 0 and sp["parts_ms"]["lm_head"] > 0 and sp["parts_ms"]["sampling"] > 0
        assert sp["sum_ms"] <= sp["measured_step_ms"] * (1 + 1e-6)  # exclusive parts: the sum is the step
        assert sp["sum_ms"] >= 0.99 * sp["measured_step_ms"]
        assert 0 < sp["model_ms"] <= sp["measured_step_ms"]
        assert math.isclose(sum(sp["shares"].values()), 1.0, rel_tol=1e-6)
        assert set(sp["matmul_read_bytes_s"]) == {*decode.LINEAR_PARTS, "lm_head"}
    floor = res["floor"]
    assert positive(floor["weight_bytes_bf16"]) and positive(floor["bandwidth_bytes_s"])
    assert positive(floor["floor_ms_per_step"]) and positive(floor["floor_tok_s"])
    cfg = llm.llm_engine.model_config
    assert floor["by_kind_bf16"]["lm_head"] == cfg.vocab_size * cfg.hidden_size * 2
    assert set(floor["floor_tok_s_by_streams"]) == {"1", "3"}
    assert all(positive(v) for v in res["measured_over_floor"].values())
    assert set(res["measured_over_round_floor"]) == {"1", "3"}
    for n, s in res["speed"].items():  # each round against the bandwidth measured at its time
        assert len(s["round_bandwidth_bytes_s_runs"]) == len(s["over_round_floor_runs"]) == 1
        assert s["probes_runs"] == [2]  # before and after: 4 tokens are fewer than the 32 steps between probes
        assert positive(s["round_bandwidth_bytes_s_runs"][0])
        assert res["measured_over_round_floor"][n] == s["over_round_floor_runs"][0]
    sizes = floor["bandwidth_before"]["sizes"]
    assert all(positive(r["sum_read_bytes_s"]) and positive(r["copy_bytes_s"]) for r in sizes)
    if native.module() is not None:
        assert all(positive(r["native_read_bytes_s"]) for r in sizes)
    decode.plot(res, str(tmp_path / "decode.png"))
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_instrumentation_comes_off(llm_factory):
    """After the split pass the engine runs uninstrumented again: no hooks, no wrapped methods, no component."""
    llm = llm_factory(prefix_cache="hash")
    engine = llm.llm_engine
    model = engine.runner.model
    sampler = engine.runner.sampler
    with decode.Instrumented(llm, decode.StepSplit()):
        assert "step" in vars(engine) and "compute_logits" in vars(model)
    assert "step" not in vars(engine) and "step" not in vars(engine.core) and "execute" not in vars(engine.runner)
    assert "compute_logits" not in vars(model) and engine.runner.sampler is sampler
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not any(isinstance(c, decode.StepSplit) for c in engine.core.components)


def test_ab_alternates_two_engines(llm_factory):
    """--ab-kernel-options: a second engine with those options, timed round by round against the first, and the
    ratio per stream count (here fp32 with and without cascade decodes: both compute, the ratio is reported)."""
    args = parse(
        "decode --input-len 8 --output-len 3 --streams 2 --repeats 2 --no-split --bandwidth-mib 4 "
        "--bandwidth-repeats 1 --ab-kernel-options cascade_decodes=1".split()
    )
    built = []

    def factory(**options):
        built.append(options)
        return llm_factory(**options)

    res = decode.run(args, llm_factory=factory)
    assert built == [{"prefix_cache": "hash"}, {"prefix_cache": "hash", "kernel_options": "cascade_decodes=1"}]
    ab = res["ab"]
    assert ab["kernel_options"] == "cascade_decodes=1" and set(ab["speed"]) == {"2"}
    assert len(ab["decode_tok_s_ratio_runs"]["2"]) == 2 and positive(ab["decode_tok_s_ratio"]["2"])
    json.dumps(res)


def test_stream_read_reads_every_byte():
    """The bandwidth probe's read pass folds every 64-bit word of the buffer into its checksum (xor), on however
    many threads: so it cannot skip any of the bytes it is timed on."""
    import numpy as np
    import torch

    module = native.module()
    if module is None:
        pytest.skip("the native kernels are not built here")
    words = torch.randint(-(2**62), 2**62, (3 * 32 * 1000,), dtype=torch.int64)  # whole 256-byte groups
    expected = int(np.bitwise_xor.reduce(words.numpy()))
    assert module.stream_read(words) == expected
    assert module.stream_read(words.view(torch.bfloat16)) == expected
    with pytest.raises(RuntimeError, match="contiguous"):
        module.stream_read(words[::2])
