"""The AVX2 variant of the native build (native.VARIANTS["avx2"], tests/model/native_builds.py) on any CPU that
runs AVX2 + FMA: it is the AVX2 build and it loads beside the main one. Its kernels run the tests of the main
build's: test_gemm.py (bf16 gemm and the float32 gemm_f32), test_fused_ops.py, and
test_invariant_attention.py and test_native_attention.py ("avx2_build"). Here, a bf16 engine runs on it end to end
(its one-call decode loop against the Python layers, warm answers against cold ones).
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import native
from tests.model.native_builds import AVX2, module


@pytest.fixture(scope="module")
def avx2():
    return module(AVX2)


def test_it_is_the_avx2_build_beside_the_main_one(avx2):
    assert avx2.attention_isa() == "avx2" and avx2.gemm_isa() == "avx2"
    assert avx2.has_gemm_f32() and avx2.fused_ops_isa() == "avx2" and not avx2.has_amx()
    assert avx2.__name__ != native.module().__name__
    assert native.build_directory(AVX2) != native.build_directory() and native.is_built(native.build_directory(AVX2))
    q, pool = torch.zeros(1, 3, 64, dtype=torch.bfloat16), torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="isa 0 only"):  # the AMX kernels are in AVX-512 builds only
        avx2.flash_attention(q, pool, torch.arange(1), torch.zeros(1, dtype=torch.long), 1.0, isa=2)


@pytest.fixture
def engine_on_avx2(avx2, monkeypatch, new_llm):
    """A bf16 engine on the AVX2 variant, as an AMD EPYC Zen 3 runs one: while the test runs, native.module()
    answers the variant, so the options, the packed weights, the attention, the fused ops and the decode loop all
    come from it (AMX kept off: the variant has none)."""
    monkeypatch.setattr(native, "module", lambda: avx2)
    monkeypatch.setattr(native, "amx_gemm", lambda: None)
    monkeypatch.setattr(native, "amx_attention", lambda: None)
    return new_llm(dtype="bfloat16", kv_cache_tokens=1024)


def test_an_engine_on_the_avx2_build_decodes_in_one_call_and_answers_alike_warm_or_cold(engine_on_avx2):
    """The AVX2 paths end to end: the engine picks them all, the one-call decode loop computes what the Python
    layers do, and a cache hit changes no bit of a greedy answer (tokens and logprobs)."""
    from prefixkv import SamplingParams

    llm = engine_on_avx2
    options, model = llm.llm_engine.runner.options, llm.llm_engine.runner.model
    assert options.isa_path == "avx2" and options.matmul == "avx2" and options.cache_invariant
    assert options.fused_ops and options.fused_decode and model.fused_decode is not None
    preamble = "You are a careful assistant. Answer in one short sentence, with no preamble, no list and no code. "
    prompts = [preamble + q for q in ("What is the capital of France?", "Why is the sky blue?", "Is 91 prime?")]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)

    cached: list[int] = []

    def answers(reset: bool = True):
        if reset:
            llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        cached[:] = [o.num_cached_tokens for o in outs]
        return [(o.outputs[0].token_ids, [s.logprob for s in o.outputs[0].logprobs]) for o in outs]

    first = answers()
    warm = answers(reset=False)  # the second time, each prompt's full pages come from the cache
    warm_hits = list(cached)
    fused, calls = model.fused_decode, []

    class Counted:  # the decode loop, counting its calls: the fused path did run
        def run(self, *args):
            calls.append(1)
            return fused.run(*args)

    model.fused_decode = Counted()
    try:
        cold = answers()
        assert calls
        model.fused_decode = None  # the Python layers
        python_layers = answers()
    finally:
        model.fused_decode = fused
    assert warm == first == cold and python_layers == cold
    assert all(len(set(tokens)) > 3 for tokens, _ in cold)  # real answers, not one token repeated
    assert any(warm_hits), warm_hits
