"""Jump-forward (on by default): the tokens a grammar forces are appended without sampling and computed as one
chunk. On these schemas greedy decoding gives the same tokens as sampling them one at a time, in fewer steps, and
the forced count is the engine's own; max_tokens, stop strings and a grammar forced to its end cut a forced run
where sampling would have stopped; a request that asks logprobs samples every token. (Warm or cold, alone or
batched, fp32 and bf16: tests/engine/test_structured_outputs.py runs with jump-forward on.)
"""

from __future__ import annotations

import json

import pytest

from prefixkv.sampling_params import SamplingParams
from prefixkv.structured_outputs import StructuredOutputs

ORDER = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 20},
        "shipping_address_postal_code": {"type": "string", "pattern": "[0-9]{5}"},
        "is_priority_delivery_requested": {"type": "boolean"},
    },
    "required": ["customer_full_name", "shipping_address_postal_code", "is_priority_delivery_requested"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ORDER_LINE = r"Order [0-9]{3}: (shipped|delayed) on 2026-[0-9]{2}-[0-9]{2}"
CASES = {
    "long keys": StructuredOutputs(json=ORDER),
    "nested call": StructuredOutputs(json=CALL),
    "regex": StructuredOutputs(regex=ORDER_LINE),
    "grammar": StructuredOutputs(grammar='start: "The answer is " ("Paris" | "Rome") "."'),
}
QUESTION = [{"role": "user", "content": "Make up an order for Alice Smith in 02139, priority, shipped today."}]


def _run(llm, so, **kwargs):
    stats = llm.llm_engine.get_stats
    before = stats()
    params = SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 48), structured_outputs=so, **kwargs)
    out = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    after = stats()
    return out, after.jump_forward_tokens_total - before.jump_forward_tokens_total, after.num_steps - before.num_steps


@pytest.fixture(scope="module")
def llms(llm_factory):
    return llm_factory(prefix_cache="hash"), llm_factory(prefix_cache="hash", jump_forward=False)


@pytest.mark.parametrize("case", CASES)
def test_forced_tokens_are_the_tokens_sampling_gives_in_fewer_steps(llms, case):
    jumping, sampling = llms
    jumped, forced, steps = _run(jumping, CASES[case])
    sampled, none_forced, sampled_steps = _run(sampling, CASES[case])
    assert jumped.token_ids == sampled.token_ids and jumped.finish_reason == sampled.finish_reason == "stop"
    assert none_forced == 0 and 0 < forced < len(jumped.token_ids)
    assert steps < sampled_steps
    if case == "long keys":
        assert set(json.loads(jumped.text)) == set(ORDER["properties"])


def test_max_tokens_stop_strings_and_a_forced_end_cut_a_forced_run(llms):
    jumping, _ = llms
    so = StructuredOutputs(regex=ORDER_LINE)
    cut, forced, _ = _run(jumping, so, max_tokens=1)  # "Order" is forced before anything is sampled
    assert cut.finish_reason == "length" and len(cut.token_ids) == forced == 1 and cut.text == "Order"
    stopped, _, _ = _run(jumping, so, stop=[":"])  # ": " is forced after the third digit
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ":"
    assert stopped.text.startswith("Order ") and len(stopped.text) == len("Order 123")
    whole, forced, steps = _run(jumping, StructuredOutputs(choice=["Reykjavik"]))  # nothing left to sample
    assert whole.text == "Reykjavik" and whole.finish_reason == "stop" and forced == len(whole.token_ids)
    assert jumping.llm_engine.get_stats().num_running == 0 and not jumping.llm_engine.has_unfinished_requests()


def test_a_request_that_asks_logprobs_samples_every_token(llms):
    jumping, sampling = llms
    out, forced, _ = _run(jumping, CASES["long keys"], logprobs=1, max_tokens=12)
    reference, _, _ = _run(sampling, CASES["long keys"], logprobs=1, max_tokens=12)
    assert forced == 0 and len(out.logprobs) == len(out.token_ids) and out.token_ids == reference.token_ids
