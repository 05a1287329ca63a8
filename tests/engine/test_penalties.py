"""Penalties and logit_bias on the Python API with the real model: they change the answer as defined, a penalized
answer is the same warm or cold and alone or batched, and a bias on a token outside the vocabulary is a
ValueError that queues nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from prefixkv.sampling_params import SamplingParams
from prefixkv.structured_outputs import StructuredOutputs
from tests import kernels

PROMPT = "List the days of the week, again and again: Monday, Tuesday, Monday, Tuesday, Monday,"


def _tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_frequency_penalty_repeats_less_and_a_bias_forces_a_token(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    prompt = llm.get_tokenizer().encode(PROMPT)
    plain = _tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    penalized = _tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0))[0]
    assert max(Counter(penalized).values()) < max(Counter(plain).values())
    forced = plain[0] + 1
    biased = _tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=3, logit_bias={forced: 100.0}))[0]
    assert biased == [forced] * 3


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=kernels.NATIVE_ATTENTION)], ids=["fp32", "bf16"]
)
def test_penalized_answers_are_the_same_warm_or_cold_alone_or_batched(llm_factory, dtype):
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.8, repetition_penalty=1.2)
    cold = llm_factory(prefix_cache="off", dtype=dtype)
    tok = cold.get_tokenizer()
    prompts = [tok.encode(PROMPT), tok.encode(PROMPT + " Tuesday, and then"), tok.encode("Say hello twice:")]
    alone = [_tokens(cold, [p], params)[0] for p in prompts]
    warm = llm_factory(prefix_cache="hash", dtype=dtype)
    warm.reset_prefix_cache()
    _tokens(warm, prompts[:1], params)  # caches the shared prefix
    free = SamplingParams(temperature=0, max_tokens=8)
    outs = warm.generate([{"prompt_token_ids": p} for p in prompts * 2], [params] * 3 + [free] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone


def test_a_bias_outside_the_vocabulary_is_a_value_error_that_queues_nothing(llm_factory):
    engine = llm_factory(prefix_cache="hash").llm_engine
    with pytest.raises(ValueError, match="logit_bias: token id 10000000 is out of range"):
        engine.add_request(None, "hi", SamplingParams(max_tokens=2, logit_bias={10_000_000: 1.0}))
    assert not engine.has_unfinished_requests()


def test_n_with_a_grammar_gives_n_valid_answers(llm_factory):
    """Each of the n completions has its own grammar state: n > 1 with structured outputs holds for every one."""
    llm = llm_factory(prefix_cache="hash")
    so = StructuredOutputs(choice=["Paris", "Rome", "Oslo"])
    out = llm.generate(
        "The capital of France is",
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, structured_outputs=so),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3 and all(c.text in ("Paris", "Rome", "Oslo") for c in out.outputs)
