"""The fused decode path (KernelOptions.fused_decode: the decoder layers of an all-decode step in one native call)
computes what the Python layers compute, bit for bit: the same greedy tokens and the same logprobs, on a real
bf16 engine, for a batch whose streams start together and one whose streams join while others decode."""

from __future__ import annotations

import pytest

from prefixkv import SamplingParams
from tests import kernels

pytestmark = kernels.DECODE_LAYERS

PROMPTS = [
    "The capital of France is",
    "Write a haiku about a cache that never forgets:",
    "List three prime numbers and explain why each is prime.",
    "def fibonacci(n):",
]


class CountingDecodeLayers:
    """The native DecodeLayers, counting its calls (so the test knows the fused path ran)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def run(self, *args):
        self.calls += 1
        return self.inner.run(*args)


@pytest.fixture(scope="module")
def engines(new_llm):
    fused = new_llm(dtype="bfloat16", kv_cache_tokens=2048)
    plain = new_llm(dtype="bfloat16", kv_cache_tokens=2048, kernel_options="fused_decode=0")
    model = fused.llm_engine.runner.model
    assert fused.llm_engine.runner.options.fused_decode and model.fused_decode is not None
    assert plain.llm_engine.runner.model.fused_decode is None
    model.fused_decode = CountingDecodeLayers(model.fused_decode)
    return fused, plain


def answers(llm, prompts, params):
    return [(o.outputs[0].token_ids, [s.logprob for s in o.outputs[0].logprobs]) for o in llm.generate(prompts, params)]


def test_fused_decode_matches_the_python_layers(engines):
    fused, plain = engines
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    counter = fused.llm_engine.runner.model.fused_decode
    before = counter.calls
    assert answers(fused, PROMPTS, params) == answers(plain, PROMPTS, params)
    assert counter.calls >= 20  # the all-decode steps took the fused path
    # streams that join while others decode: steps mixing a prefill with decodes take the Python layers
    engine_f, engine_p = fused.llm_engine, plain.llm_engine
    outs = []
    for engine in (engine_f, engine_p):
        engine.add_request("a", PROMPTS[0], params)
        for _ in range(5):
            engine.step()
        engine.add_request("b", PROMPTS[1], params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outs.append(done)
    assert outs[0] == outs[1] and counter.calls > before + 20


def test_fused_decode_is_on_with_cache_invariance_only():
    import torch

    from prefixkv.model.options import KernelOptions

    cpu = torch.device("cpu")
    bf16 = KernelOptions.choose(cpu, torch.bfloat16)
    assert bf16.fused_decode and bf16.cache_invariant
    assert not KernelOptions.choose(cpu, torch.bfloat16, cache_invariant=False).fused_decode
    assert not KernelOptions.choose(cpu, torch.float32).fused_decode
    with pytest.raises(ValueError, match="fused_decode needs cache_invariant"):
        KernelOptions.choose(cpu, torch.float32, fused_decode=True)
