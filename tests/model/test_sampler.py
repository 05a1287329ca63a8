"""Sampler: greedy is argmax, top_k=1 equals greedy, seeded draws depend only on (seed, step), logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from prefixkv.model.penalties import apply_penalties
from prefixkv.model.sampler import Sampler
from prefixkv.sampling_params import SamplingParams

V = 1000


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits(5)
    out = Sampler(0)(x, [SamplingParams(temperature=0)] * 5, [0] * 5)
    assert [s.token_id for s in out] == x.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    x = logits(4)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 4
    assert [s.token_id for s in Sampler()(x, params, [0] * 4)] == x.argmax(-1).tolist()


def test_seeded_is_reproducible_across_batches_and_steps():
    x = logits(3)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    a = Sampler(1)(x[:1], [seeded], [5])[0].token_id
    # same logits row at another batch position, next to unseeded rows, with another runner generator
    batch = torch.cat([x[1:3], x[:1]])
    assert Sampler(2)(batch, [other, other, seeded], [0, 0, 5])[2].token_id == a
    # different steps give (in general) different draws
    draws = {Sampler()(x[:1], [seeded], [step])[0].token_id for step in range(20)}
    assert len(draws) > 1


def test_sampling_respects_top_p_and_min_p():
    x = torch.full((1, V), -10.0)
    x[0, 7], x[0, 8], x[0, 9] = 5.0, 4.9, 0.0
    s = Sampler(0)
    for i in range(30):
        t = s(x, [SamplingParams(temperature=1.0, top_p=0.9)], [i])[0].token_id
        assert t in (7, 8)
        t = s(x, [SamplingParams(temperature=1.0, min_p=0.5)], [i])[0].token_id
        assert t in (7, 8)


def test_logprobs():
    x = logits(2)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.8, logprobs=0, seed=1)]
    out = Sampler(0)(x, params, [0, 0])
    ref = torch.log_softmax(x, -1)
    assert len(out[0].top_logprobs) == 5 and out[1].top_logprobs == []
    assert math.isclose(out[0].logprob, ref[0].max().item(), rel_tol=1e-5)
    assert out[0].top_logprobs[0][0] == out[0].token_id
    assert math.isclose(out[1].logprob, ref[1, out[1].token_id].item(), rel_tol=1e-5)
    assert [v for _, v in out[0].top_logprobs] == sorted((v for _, v in out[0].top_logprobs), reverse=True)


def test_logit_bias_and_penalties_follow_their_definitions():
    """logit_bias adds; frequency subtracts per output occurrence, presence once; repetition divides a positive
    logit and multiplies a negative one of any token in the prompt or the output (vLLM's definitions)."""
    x = torch.zeros(1, V)
    x[0, 1], x[0, 2], x[0, 3] = 4.0, -2.0, 1.0
    history = ([1, 2, 3, 3], 2)  # prompt [1, 2], output [3, 3]
    cases = [
        (SamplingParams(temperature=0, logit_bias={5: 10.0}), {5: 10.0, 1: 4.0}),
        (SamplingParams(temperature=0, frequency_penalty=0.5), {3: 0.0, 1: 4.0}),
        (SamplingParams(temperature=0, presence_penalty=0.5), {3: 0.5, 1: 4.0}),
        (SamplingParams(temperature=0, repetition_penalty=2.0), {1: 2.0, 2: -4.0, 3: 0.5, 4: 0.0}),
    ]
    for params, expected in cases:
        changed = _processed(x, params, history)
        for token, value in expected.items():
            assert changed[token] == value, (params, token)


def _processed(x: torch.Tensor, params: SamplingParams, history) -> torch.Tensor:
    return apply_penalties(x, [params], [history if params.penalized else None])[0]


def test_a_penalized_row_is_the_same_alone_or_batched_and_masked_tokens_stay_masked():
    x = logits(3)
    x[1, 7] = float("-inf")  # a token the grammar blocked
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.7, seed=3, presence_penalty=-1.0),
    ]
    histories = [None, ([4, 7, 9, 9], 1), ([x[2].argmax().item()], 0)]
    batched = Sampler(0)(x, params, [0, 3, 1], histories)
    alone = [Sampler(0)(x[i : i + 1], [params[i]], [[0, 3, 1][i]], [histories[i]])[0] for i in range(3)]
    assert [s.token_id for s in batched] == [s.token_id for s in alone]
    assert batched[1].token_id != 7
    assert apply_penalties(x, params, histories)[1, 7] == float("-inf")


def test_bad_penalties_are_value_errors_that_name_the_field():
    for kwargs, field in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="logit_bias: token id 5000"):
        SamplingParams(logit_bias={5000: 1.0}).check_vocab(V)
