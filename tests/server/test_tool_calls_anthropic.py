"""Tool use on the Messages API through the official anthropic SDK against the real server, on the default 135M
model: a forced tool_use block fits its input_schema, stop_reason is tool_use, the streamed input_json_delta
events assemble to the same input, a tool_result round trip reads the first turn and the call from the cache,
a cache_control on a tool is a breakpoint at the end of that tool's definition, and bad tool fields are 400s in
Anthropic's error shape.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.live_server import running_server
from tests.server.round_trip import assert_reads_into_the_first_answer

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city today.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}},
}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(kv_cache_tokens=4096)
    with running_server(engine) as (base, engine, _):
        yield anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0), base, engine


def ask(client, engine, messages, **kwargs):
    kwargs = {
        "tools": [WEATHER, TIME],
        "extra_body": {"temperature": 0},
        "max_tokens": 64,
        "system": "Use the tools.",
        **kwargs,
    }
    return client.messages.create(model=engine.model_name, messages=messages, **kwargs)


def test_a_forced_tool_use_fits_its_schema(served):
    client, _, engine = served
    out = ask(
        client,
        engine,
        [QUESTION],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    assert out.stop_reason == "tool_use"
    (block,) = [b for b in out.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    assert set(block.input) == {"city", "unit"} and block.input["unit"] in ("celsius", "fahrenheit")


def test_streamed_tool_use_assembles_to_the_same_input(served):
    client, _, engine = served
    kwargs = dict(tool_choice={"type": "any", "disable_parallel_tool_use": True})
    whole = ask(client, engine, [QUESTION], **kwargs)
    with client.messages.stream(
        model=engine.model_name,
        messages=[QUESTION],
        tools=[WEATHER, TIME],
        extra_body={"temperature": 0},
        max_tokens=64,
        system="Use the tools.",
        **kwargs,
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds and streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in whole.content if b.type == "tool_use"
    ]


def test_a_tool_result_round_trip_reads_the_call_from_the_cache(served):
    client, _, engine = served
    engine.reset_prefix_cache()
    first = ask(client, engine, [QUESTION], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (call,) = [b for b in first.content if b.type == "tool_use"]
    second = ask(
        client,
        engine,
        [
            QUESTION,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, clear"}]},
        ],
    )
    u = first.usage
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert_reads_into_the_first_answer(
        second.usage.cache_read_input_tokens, prompt, u.output_tokens, engine.config.page_size
    )


def test_a_cache_control_on_a_tool_is_a_breakpoint(served):
    client, base, engine = served
    engine.reset_prefix_cache()
    tools = [WEATHER, {**TIME, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = ask(client, engine, [QUESTION], tools=tools, max_tokens=2)
    assert first.usage.cache_creation.ephemeral_1h_input_tokens > 0
    # the same tools under another system prompt: the tool block still hits
    other = ask(client, engine, [QUESTION], tools=tools, system="Answer briefly.", max_tokens=2)
    assert other.usage.cache_read_input_tokens >= first.usage.cache_creation.ephemeral_1h_input_tokens
    counted = client.messages.count_tokens(
        model=engine.model_name, messages=[QUESTION], tools=tools, system="Use the tools."
    )
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_creation_input_tokens + (
        first.usage.cache_read_input_tokens
    )


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
        ({"tools": [WEATHER, WEATHER]}, "two tools are named"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom (client) tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type must be"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "got 'image'"),
    ],
)
def test_bad_tool_fields_are_400s(served, fields, words):
    _, base, engine = served
    body = {"model": engine.model_name, "messages": [QUESTION], "max_tokens": 4, "tools": [WEATHER], **fields}
    r = httpx.post(base + "/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert words in r.json()["error"]["message"]
    ok = httpx.post(base + "/v1/messages", json={"model": engine.model_name, "messages": [QUESTION], "max_tokens": 2})
    assert ok.status_code == 200
