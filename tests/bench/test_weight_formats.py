"""`prefixkv bench weight-formats` at a tiny size on real bf16 engines: the JSON's shape, dense agrees with itself
completely, and the quantized formats report a finite perplexity and an agreement share. No speed assertions."""

from __future__ import annotations

import argparse
import json
import math

from prefixkv.bench import weight_formats
from prefixkv.model import native
from tests import kernels

pytestmark = kernels.requires("avx512f", native.qgemm, "the quantized matrix product (qgemm)")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    weight_formats.register(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def test_weight_formats_json(llm_factory):
    args = parse(
        "weight-formats --formats dense,gguf --streams 2 --repeats 1 --output-len 4 --input-len 8 "
        "--answer-tokens 8 --num-prompts 3".split()
    )
    assert args.dtype == "bfloat16"
    built = []

    def factory(**options):  # the float32 reference is the suite's shared fp32 engine (no engine of its own)
        built.append(options.get("weight_format", options.get("dtype")))
        if options.get("dtype") == "float32":
            return llm_factory(prefix_cache="hash")
        return llm_factory(dtype="bfloat16", kv_cache_tokens=2048, **options)

    res = weight_formats.run(args, llm_factory=factory)
    json.dumps(res)
    assert built == ["dense", "gguf", "float32"] and res["config"]["formats"] == ["dense", "gguf"]
    assert res["kernels"]["gguf"]["weights"] == "gguf" and res["kernels"]["dense"]["weights"] == "dense"
    quality = res["quality"]
    dense, gguf, fp32 = quality["dense"], quality["gguf"], quality["float32"]
    assert dense["vs_dense"]["token_agreement"] == 1.0 and dense["vs_dense"]["identical_answers"] == 3
    assert fp32["vs_reference"]["token_agreement"] == 1.0
    assert 0 <= gguf["vs_reference"]["token_agreement"] <= 1
    assert gguf["tokens_scored"] == dense["tokens_scored"] == fp32["tokens_scored"] > 400
    assert all(math.isfinite(q["perplexity"]) and q["perplexity"] > 1 for q in (dense, gguf, fp32))
    assert res["decode_tok_s_vs_dense"]["dense"]["2"] == 1.0
    assert res["speed"]["gguf"]["2"]["decode_tok_s"] > 0
