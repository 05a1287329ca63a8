"""Bad input gets a clear ValueError and loses nothing: other requests finish and no page leaks."""

from __future__ import annotations

import pytest

from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_fail_alone(llm_factory):
    llm = llm_factory(prefix_cache="hash", max_model_len=256, kv_cache_tokens=1024)  # holds 4 whole contexts
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
    for held in (-1, True, "16"):  # a router's count of tokens another replica holds
        with pytest.raises(ValueError, match="held_elsewhere_tokens"):
            engine.add_request(None, "hello", RequestOptions(SamplingParams(max_tokens=4), held_elsewhere_tokens=held))
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


def test_stop_strings_and_stop_token_ids_end_generation(llm_factory):
    llm = llm_factory(prefix_cache="off")
    prompt = "List the planets of the solar system, separated by commas:"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(ids) == 24
    stop = text[6:9]  # a piece that first occurs at or after position 6
    cut = text.find(stop)
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    out = stopped.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)  # stop text not included
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[4]]), use_tqdm=False)[
        0
    ].outputs[0]
    first = ids.index(ids[4])
    assert by_id.token_ids == ids[: first + 1] and by_id.finish_reason == "stop" and by_id.stop_reason == ids[4]
