"""Random-weight checkpoints in real models' shapes (prefixkv.model.shapes), small versions: transformers loads
each as it is, fp32 greedy equals transformers', caching on equals off, and the answers are not degenerate."""

from __future__ import annotations

import pytest
import torch

from prefixkv.llm import LLM
from prefixkv.model.shapes import SHAPES, model_record, write_checkpoint
from prefixkv.sampling_params import SamplingParams
from tests.model.conftest import hf_greedy

NEW_TOKENS = 8
SHARED = [1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 17, 9046, 1232, 44, 1006, 2342, 30, 339, 3543, 5248] * 2
SUFFIXES = ([57, 880, 15], [4020, 11, 903, 77], [610])


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    made: dict[str, tuple[str, dict]] = {}

    def make(name: str) -> tuple[str, dict]:
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            made[name] = (path, write_checkpoint(name, path, small=True))
        return made[name]

    return make


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_small_shape_equals_transformers_and_caching_on_equals_off(small_checkpoint, name):
    from transformers import AutoModelForCausalLM

    path, record = small_checkpoint(name)
    real = SHAPES[name].config
    assert record == model_record(path)
    assert record["head_dim"] == real["head_dim"]
    assert record["qk_norm"] == (real["model_type"] == "qwen3")
    ratio = real["num_attention_heads"] // real["num_key_value_heads"]
    assert record["num_heads"] // record["num_kv_heads"] == ratio  # the GQA ratio the kernels see

    hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor: transformers reads it as is
    prompts = [SHARED + s for s in SUFFIXES]
    expected = [hf_greedy(hf.eval(), p, NEW_TOKENS) for p in prompts]
    del hf
    assert all(len(set(e)) >= 3 for e in expected), expected  # distinct tokens: a degenerate answer cannot agree

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for cache in ("off", "hash", "radix"):
        llm = LLM(model=path, dtype="float32", prefix_cache=cache, kv_cache_tokens=512, debug_nan_kv=True)
        outs = [llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == expected, cache
        assert cache == "off" or outs[-1].num_cached_tokens >= 32  # the later prompts read the shared prefix
        assert llm.llm_engine.get_stats().num_pages_used == 0


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_small_shape_bf16_answers_same_warm_cold_alone_batched(small_checkpoint, name):
    """bf16 on prefixkv's own kernels (head_dim 64 and 128, q/k norms included): every step's top logprobs equal bit
    for bit, cold one at a time, warm from the cache (hash, 16-token pages), all in one batch, and with the decode
    steps on the Python layers instead of the one native decode call."""
    path, _ = small_checkpoint(name)
    llm = LLM(model=path, dtype="bfloat16", prefix_cache="hash", kv_cache_tokens=512, debug_nan_kv=True)
    options = llm.llm_engine.runner.options
    assert options.native_attention and options.cache_invariant and options.fused_decode, options
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": SHARED + s} for s in SUFFIXES]

    def answers(outs) -> list:
        return [[(s.token_id, s.logprob, s.top_logprobs) for s in o.outputs[0].logprobs] for o in outs]

    llm.reset_prefix_cache()
    cold = answers([llm.generate(p, params, use_tqdm=False)[0] for p in prompts[:1]])
    warm_outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert warm_outs[0].num_cached_tokens >= 32 and warm_outs[-1].num_cached_tokens >= 32
    llm.reset_prefix_cache()
    batched = answers(llm.generate(prompts, params, use_tqdm=False))
    warm = answers(warm_outs)
    assert warm[0] == cold[0]
    assert batched == warm
    model = llm.llm_engine.runner.model
    fused, model.fused_decode = model.fused_decode, None  # the Python layers: what the one native decode call runs
    llm.reset_prefix_cache()
    assert answers(llm.generate(prompts, params, use_tqdm=False)) == batched
    model.fused_decode = fused
    assert all(len({t for t, _, _ in a}) >= 3 for a in warm)  # distinct tokens: not a degenerate answer
