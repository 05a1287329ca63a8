"""Bad input gets a clear ValueError and loses nothing: other requests finish and no page leaks."""
from __future__ import annotations

import pytest

from prefixkv.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"), ({"seed": "x"}, "seed"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_fail_alone(llm_factory):
    llm = llm_factory(prefix_cache="hash", max_model_len=256)
    engine = llm.llm_engine
    good = [engine.add_request(None, f"Count to {i}:", SamplingParams(temperature=0, max_tokens=8)) for i in range(3)]
    engine.step()  # good requests are in flight when the bad ones arrive
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(None, {"prompt_token_ids": [100] * 300}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(None, "hello", SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(None, {"prompt_token_ids": [10**9]}, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [5] * 999}], SamplingParams(max_tokens=2), use_tqdm=False)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(good) <= set(done)
    assert all(len(done[g].outputs[0].token_ids) > 0 and done[g].outputs[0].finish_reason != "abort" for g in good)
    # the half-added batch of the failed generate() was aborted, not left running
    assert all(o.outputs[0].finish_reason == "abort" for rid, o in done.items() if rid not in good)
    assert engine.get_stats().num_pages_used == 0


def test_unknown_model_is_a_value_error():
    from prefixkv.llm import LLM

    with pytest.raises(ValueError):
        LLM(model="no-such-model-anywhere")
    with pytest.raises(ValueError, match="prefix_cache"):
        LLM(prefix_cache="lru")
