"""Function calling on Gemini's generateContent through the official google-genai SDK against the real server, on
the default 135M model: mode ANY gives a functionCall part that fits its declaration (the SDK's OpenAPI-subset
schema and a JSON Schema both), streamed or not, allowedFunctionNames narrows the call, and a functionResponse
round trip reads the first turn and the call from the cache.
"""

from __future__ import annotations

import httpx
import pytest
from google import genai
from google.genai import types

from prefixkv.tools.prompt import call_text, compact_json
from prefixkv.tools.spec import ToolCall
from tests.server.live_server import running_server

WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="The weather in a city today.",
    parameters=types.Schema(
        type="OBJECT",
        properties={
            "city": types.Schema(type="STRING", max_length=20),
            "unit": types.Schema(type="STRING", enum=["celsius", "fahrenheit"]),
        },
        required=["city", "unit"],
    ),
)
TIME = types.FunctionDeclaration(
    name="get_time",
    description="The local time in a city.",
    parameters_json_schema={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
)
QUESTION = "What is the weather in Paris?"


def config(mode="ANY", names=None, **kwargs):
    calling = types.FunctionCallingConfig(mode=mode, allowed_function_names=names)
    return types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[WEATHER, TIME])],
        tool_config=types.ToolConfig(function_calling_config=calling),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        temperature=0,
        max_output_tokens=64,
        system_instruction="Use the tools.",
        **kwargs,
    )


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(kv_cache_tokens=4096)
    with running_server(engine) as (base, engine, _):
        client = genai.Client(api_key="unused", http_options=types.HttpOptions(base_url=base))
        yield client, base, engine


def test_mode_any_gives_a_valid_function_call(served):
    client, _, engine = served
    out = client.models.generate_content(
        model=engine.model_name, contents=QUESTION, config=config(names=["get_weather"])
    )
    (call,) = out.function_calls
    assert call.name == "get_weather" and set(call.args) == {"city", "unit"}
    assert call.args["unit"] in ("celsius", "fahrenheit")


def test_a_streamed_call_is_the_same_call(served):
    client, _, engine = served
    whole = client.models.generate_content(model=engine.model_name, contents=QUESTION, config=config())
    streamed = [
        c
        for chunk in client.models.generate_content_stream(model=engine.model_name, contents=QUESTION, config=config())
        for c in chunk.function_calls or []
    ]
    assert [(c.name, c.args) for c in streamed] == [(c.name, c.args) for c in whole.function_calls]


def test_a_function_response_round_trip_reads_the_call_from_the_cache(served):
    client, _, engine = served
    engine.reset_prefix_cache()
    question = types.Content(role="user", parts=[types.Part(text=QUESTION)])
    first = client.models.generate_content(model=engine.model_name, contents=[question], config=config())
    answer = first.candidates[0].content
    result = types.Part.from_function_response(name=first.function_calls[0].name, response={"temperature": 21})
    second = client.models.generate_content(
        model=engine.model_name,
        contents=[question, answer, types.Content(role="user", parts=[result])],
        config=config(mode="AUTO"),
    )
    # the first answer may go on calling until max_output_tokens (Gemini has no switch for one call): the next
    # turn shares the prompt and the first call, written back token for token
    call = first.function_calls[0]
    text = call_text(ToolCall("", call.name, compact_json(call.args)))
    shared = first.usage_metadata.prompt_token_count + len(engine.tokenizer.hf.encode(text, add_special_tokens=False))
    page = engine.config.page_size
    assert second.usage_metadata.cached_content_token_count == shared // page * page


@pytest.mark.parametrize(
    "tools, tool_config, words",
    [
        ([{"googleSearch": {}}], None, "only functionDeclarations"),
        ([{"functionDeclarations": [{"name": "f"}, {"name": "f"}]}], None, "two tools are named"),
        ([{"functionDeclarations": [{"name": "f"}]}], {"functionCallingConfig": {"mode": "SOMETIMES"}}, "mode must"),
        (
            [{"functionDeclarations": [{"name": "f"}]}],
            {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["g"]}},
            "not among the functionDeclarations",
        ),
    ],
)
def test_bad_tools_are_400s(served, tools, tool_config, words):
    _, base, engine = served
    body = {"contents": [{"parts": [{"text": QUESTION}]}], "tools": tools, "toolConfig": tool_config}
    r = httpx.post(f"{base}/v1beta/models/{engine.model_name}:generateContent", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
