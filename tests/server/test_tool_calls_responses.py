"""Function calls on the Responses API through the official openai SDK against the real server, on the default
135M model: a forced call is a function_call item that fits its schema, the streamed arguments assemble to the same
call, and a function_call_output round trip (sent whole, or after previous_response_id) reads the first turn and
the call from the cache.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.live_server import running_server
from tests.server.round_trip import assert_reads_into_the_first_answer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city today.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
QUESTION = "What is the weather in Paris?"
FORCED = {"tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(kv_cache_tokens=4096)
    with running_server(engine) as (base, engine, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0), engine


def ask(client, engine, input, **kwargs):
    kwargs = {"tools": [WEATHER], "temperature": 0, "max_output_tokens": 64, "instructions": "Use the tools.", **kwargs}
    return client.responses.create(model=engine.model_name, input=input, **kwargs)


def test_a_forced_call_is_a_function_call_item(served):
    client, engine = served
    out = ask(client, engine, QUESTION, **FORCED)
    (item,) = out.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    assert set(json.loads(item.arguments)) == {"city", "unit"} and out.status == "completed"
    assert out.tool_choice.name == "get_weather" and out.parallel_tool_calls is False


def test_streamed_arguments_assemble_to_the_same_call(served):
    client, engine = served
    whole = ask(client, engine, QUESTION, **FORCED).output[0]
    deltas, done = "", None
    for event in ask(client, engine, QUESTION, stream=True, **FORCED):
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        if event.type == "response.completed":
            done = event.response
    (item,) = done.output
    assert deltas == item.arguments == whole.arguments and item.name == whole.name


@pytest.mark.parametrize("chained", [False, True], ids=["sent-whole", "previous_response_id"])
def test_a_function_call_output_round_trip_reads_the_call_from_the_cache(served, chained):
    client, engine = served
    engine.reset_prefix_cache()
    first = ask(client, engine, [{"role": "user", "content": QUESTION}], **FORCED)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    if chained:
        second = ask(client, engine, [result], previous_response_id=first.id)
    else:
        sent = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
        second = ask(client, engine, sent)
    cached = second.usage.input_tokens_details.cached_tokens
    u = first.usage
    assert_reads_into_the_first_answer(cached, u.input_tokens, u.output_tokens, engine.config.page_size)
