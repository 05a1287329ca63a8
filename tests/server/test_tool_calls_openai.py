"""Tool calls on Chat Completions through the official openai SDK against the real server, on the default 135M
model: forced calls parse and fit their schemas (the grammar holds them), streamed calls assemble to the same
calls, a tool result's round trip reads the first turn and the call from the cache, typed tools parse into their
models, and bad tool fields are 400s that name the field while the server keeps serving.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.server.live_server import running_server
from tests.server.round_trip import assert_reads_into_the_first_answer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}},
    },
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


class Lookup(BaseModel):
    city: str
    days: int


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(kv_cache_tokens=4096)
    with running_server(engine) as (base, engine, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0), base, engine


def ask(client, engine, messages, **kwargs):
    kwargs = {"tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 64, **kwargs}
    return client.chat.completions.create(model=engine.model_name, messages=messages, **kwargs)


def test_a_named_call_is_valid_and_ends_with_tool_calls(served):
    client, _, engine = served
    out = ask(
        client,
        engine,
        [SYSTEM, QUESTION],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def test_auto_may_answer_in_text(served):
    client, _, engine = served
    out = ask(client, engine, [{"role": "user", "content": "Say hello."}], max_tokens=16)
    message = out.choices[0].message
    assert message.tool_calls or (message.content and "<tool_call>" not in message.content)


def test_streamed_calls_assemble_to_the_whole_answer(served):
    client, _, engine = served
    kwargs = dict(tool_choice="required", parallel_tool_calls=False)
    whole = ask(client, engine, [SYSTEM, QUESTION], **kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, engine, [SYSTEM, QUESTION], stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            assert not choice.delta.content
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    (expected,) = whole.message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (expected.function.name, expected.function.arguments)
    ]
    assert calls[0]["id"].startswith("call_")


def test_a_tool_result_round_trip_reads_the_call_from_the_cache(served):
    client, _, engine = served
    engine.reset_prefix_cache()
    first = ask(client, engine, [SYSTEM, QUESTION], tool_choice="required", parallel_tool_calls=False)
    (call,) = first.choices[0].message.tool_calls
    second = ask(
        client,
        engine,
        [
            SYSTEM,
            QUESTION,
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
        ],
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    u = first.usage
    assert_reads_into_the_first_answer(cached, u.prompt_tokens, u.completion_tokens, engine.config.page_size)


def test_typed_tools_parse_into_their_models(served):
    client, _, engine = served
    out = client.chat.completions.parse(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Look up Rome for 3 days."}],
        tools=[openai.pydantic_function_tool(Lookup)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=48,
    )
    (call,) = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]", "1-64 letters"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"functions": [WEATHER["function"]]}, "functions", "use tools"),
        ({"response_format": None, "structured_outputs": {"regex": "a+"}}, "tools", "cannot be combined with tools"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(served, fields, param, words):
    _, base, engine = served
    body = {"model": engine.model_name, "messages": [QUESTION], "max_tokens": 4, "tools": [WEATHER], **fields}
    r = httpx.post(base + "/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(base + "/v1/chat/completions", json={"messages": [QUESTION], "max_tokens": 2})
    assert ok.status_code == 200
