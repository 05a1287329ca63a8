"""The fused decode path (KernelOptions.fused_decode: the decoder layers of an all-decode step in one native call)
computes what the Python layers compute, bit for bit: the same greedy tokens and the same logprobs, on a real
bf16 engine, for a batch whose streams start together and one whose streams join while others decode. One engine:
the Python layers run when the model's fused decode call is taken away (what fused_decode=0 builds)."""

from __future__ import annotations

from contextlib import contextmanager

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


@contextmanager
def python_layers(llm):
    """The engine's steps run the Python layers (the fused call taken away, as fused_decode=0 leaves it)."""
    model = llm.llm_engine.runner.model
    fused, model.fused_decode = model.fused_decode, None
    try:
        yield
    finally:
        model.fused_decode = fused


@pytest.fixture(scope="module")
def llm(new_llm):
    llm = new_llm(dtype="bfloat16", kv_cache_tokens=2048)
    model = llm.llm_engine.runner.model
    assert llm.llm_engine.runner.options.fused_decode and model.fused_decode is not None
    model.fused_decode = CountingDecodeLayers(model.fused_decode)
    return llm


def answers(llm, prompts, params):
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [s.logprob for s in o.outputs[0].logprobs]) for o in outs]


def joining(engine, params) -> dict:
    """Stream b joins while stream a decodes: steps mixing a prefill with decodes take the Python layers."""
    engine.add_request("a", PROMPTS[0], params)
    for _ in range(5):
        engine.step()
    engine.add_request("b", PROMPTS[1], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_fused_decode_matches_the_python_layers(llm):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    counter = llm.llm_engine.runner.model.fused_decode
    before = counter.calls
    fused = answers(llm, PROMPTS, params)
    assert counter.calls >= before + 20  # the all-decode steps took the fused path
    with python_layers(llm):
        assert answers(llm, PROMPTS, params) == fused
    llm.reset_prefix_cache()
    calls = counter.calls
    fused_joining = joining(llm.llm_engine, params)
    assert counter.calls > calls + 10
    llm.reset_prefix_cache()
    with python_layers(llm):
        assert joining(llm.llm_engine, params) == fused_joining


def test_fused_decode_shares_out_rows_beyond_16(llm):
    """More than 16 decodes in a step: the loop's per-row kernels run on both threads, as the tensor kernels do,
    and every row still gets the Python layers' bits."""
    prompts = [[1000 + 97 * s + i for i in range(8 + s)] for s in range(20)]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=1, ignore_eos=True)
    counter = llm.llm_engine.runner.model.fused_decode
    before = counter.calls
    fused = answers(llm, prompts, params)
    assert counter.calls > before
    with python_layers(llm):
        assert answers(llm, prompts, params) == fused


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


def test_fused_decode_refuses_what_it_cannot_compute(llm):
    """The native loop checks its inputs once per call, before it writes anything: a slot outside the pool, a
    length past the page table or a wrong dtype is an error, and the pool is left as it was."""
    import torch

    model = llm.llm_engine.runner.model
    layers, pool, c = model.fused_decode.inner, model.kv_cache, model.config
    h = torch.zeros(1, c.hidden_size, dtype=torch.bfloat16)
    cos = torch.ones(1, 1, c.head_dim, dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    table, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    before = pool.clone()
    with pytest.raises(RuntimeError, match="not in the pool"):
        layers.run(h, cos, sin, pool, torch.tensor([pool.shape[3]]), table, lens, 16, 0.125, 0)
    with pytest.raises(RuntimeError, match="each length"):
        layers.run(h, cos, sin, pool, torch.tensor([0]), table, torch.tensor([17]), 16, 0.125, 0)
    with pytest.raises(RuntimeError, match="h must be"):
        layers.run(h.float(), cos, sin, pool, torch.tensor([0]), table, lens, 16, 0.125, 0)
    with pytest.raises(RuntimeError, match="isa must be"):
        layers.run(h, cos, sin, pool, torch.tensor([0]), table, lens, 16, 0.125, 7)
    assert torch.equal(pool, before)
