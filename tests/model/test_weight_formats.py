"""Weight-only quantized weights (weight_format "gguf" and "q8_0", prefixkv/model/quantized.py) on the real model:
the GGUF's own blocks are kept per fused weight and stand for exactly the float weights the model loads; an
engine reads them with the qgemm kernel; a cache hit and a batch never change an answer within a format; the fused
decode path computes what the Python layers compute; impossible requests are refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.model import quantized
from tests import kernels

QGEMM = kernels.requires("avx512f", lambda: quantized.native.qgemm(), "the quantized matrix product (qgemm)")

SYSTEM = (
    "You are a careful assistant for a team of engineers. Answer briefly and precisely, show your reasoning when "
    "it helps, and say plainly when you are unsure. "
)  # over two 16-token pages: warm requests hit them
PROMPTS = [
    SYSTEM + "The capital of France is",
    SYSTEM + "Write a haiku about a cache that never forgets:",
    SYSTEM + "List three prime numbers and explain why each is prime.",
]


def test_file_blocks_stand_for_the_loaded_weights(loaded_model):
    """The kept q4_1 / q8_0 blocks, dequantized by gguf's reference, are the fp32 weights load_weights fused (q/k
    rows un-permuted, q/k/v and gate/up stacked in the same order)."""
    model = loaded_model("float32").model
    blocks = model.file_blocks
    assert blocks["layers.0.self_attn.qkv_proj.weight"].format == "q4_1"
    assert blocks["embed_tokens.weight"].format == "q8_0"
    assert len(blocks) == 4 * model.config.num_layers + 1
    params = dict(model.named_parameters())
    for name in ("layers.0.self_attn.qkv_proj.weight", "layers.7.mlp.gate_up_proj.weight", "embed_tokens.weight"):
        assert torch.equal(quantized.dequantize(blocks[name]), params[name]), name


def test_bad_requests_are_refused(new_llm):
    with pytest.raises(ValueError, match="weight_format"):
        new_llm(kv_cache_tokens=256, weight_format="q3_k")
    with pytest.raises(ValueError, match="weight_format q8_0 needs bfloat16"):
        new_llm(kv_cache_tokens=256, weight_format="q8_0")  # float32 activations
    with pytest.raises(ValueError, match="not supported"):
        quantized.QuantizedBlocks("q4_k", torch.zeros(1, 144, dtype=torch.uint8).numpy(), 256)
    with pytest.raises(ValueError, match="do not hold rows"):
        quantized.QuantizedBlocks("q8_0", torch.zeros(2, 30, dtype=torch.uint8).numpy(), 32)


@pytest.fixture(scope="module", params=["gguf", "q8_0"])
def engine(request, new_llm):
    """A bf16 engine reading its weights in this format."""
    return request.param, new_llm(dtype="bfloat16", kv_cache_tokens=2048, weight_format=request.param)


@QGEMM
def test_quantized_engines(engine):
    from tests.model.test_fused_decode import python_layers

    fmt, llm = engine
    runner = llm.llm_engine.runner
    assert llm.llm_engine.kernels["weights"] == fmt and runner.options.cache_invariant and runner.options.fused_decode
    model = runner.model
    layer = model.layers[0]
    want = "q4_1" if fmt == "gguf" else "q8_0"
    assert layer.self_attn.qkv_proj.packed.path == want and layer.mlp.down_proj.packed.path == want
    assert model.lm_head_packed.path == "q8_0"  # the file's q8_0 embedding is the tied lm_head
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)

    def answers(prompts, outs=None):
        outs = outs or llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [s.logprob for s in o.outputs[0].logprobs]) for o in outs]

    llm.reset_prefix_cache()
    cold_batch = answers(PROMPTS)
    llm.reset_prefix_cache()
    with python_layers(llm):  # the fused decode path reads the same blocks: the same bits
        assert answers(PROMPTS) == cold_batch
    llm.reset_prefix_cache()
    alone = [answers([p])[0] for p in PROMPTS]  # each prompt alone, cold (the pages of the others are cached)
    assert alone == cold_batch  # a batch never changes an answer
    warm = llm.generate(PROMPTS, params, use_tqdm=False)  # every prompt now hits its own cached pages
    assert all(o.num_cached_tokens >= 32 for o in warm)
    assert answers(PROMPTS, warm) == cold_batch  # a cache hit never changes an answer
