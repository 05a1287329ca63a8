"""Structured outputs through each API's own official SDK against the real server, on the default 135M model: the
grammar holds the answer to the schema, so even this model's answers parse. Bad constraints are 400s in each API's
shape, and the server keeps serving.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types
from pydantic import BaseModel

from tests.server.live_server import running_server


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


VERDICT_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
QUESTION = "Is Paris the capital of France? Answer as JSON."


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(kv_cache_tokens=4096)
    with running_server(engine) as (base, engine, _):
        yield base, engine


def test_openai_parse_returns_the_typed_object(served):
    base, engine = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    compiled = engine.grammars.compiles
    for _ in range(2):
        out = client.chat.completions.parse(
            model=engine.model_name,
            messages=[{"role": "user", "content": QUESTION}],
            response_format=Verdict,
            temperature=0,
            max_tokens=32,
        )
        message = out.choices[0].message
        assert isinstance(message.parsed, Verdict) and out.choices[0].finish_reason == "stop"
    assert engine.grammars.compiles == compiled + 1  # the same schema again compiles nothing


def test_openai_json_object_and_vllm_structured_outputs(served):
    base, engine = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    ask = dict(model=engine.model_name, messages=[{"role": "user", "content": QUESTION}], temperature=0)
    obj = client.chat.completions.create(**ask, response_format={"type": "json_object"}, max_tokens=200)
    text = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: what came is a JSON object's beginning
        assert obj.choices[0].finish_reason == "length" and text.startswith("{")
    choice = client.completions.create(
        model=engine.model_name,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}},
    )
    assert choice.choices[0].text in ("Paris", "Lyon")
    phone = client.completions.create(
        model=engine.model_name,
        prompt="Call me at",
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert len(phone.choices[0].text) == 8 and phone.choices[0].text[3] == "-"


def test_responses_parse(served):
    base, engine = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    out = client.responses.parse(
        model=engine.model_name, input=QUESTION, text_format=Verdict, temperature=0, max_output_tokens=32
    )
    assert isinstance(out.output_parsed, Verdict)


def test_anthropic_output_config_format(served):
    base, engine = served
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    out = client.messages.create(
        model=engine.model_name,
        max_tokens=32,
        messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": VERDICT_SCHEMA}},
    )
    assert Verdict.model_validate_json(out.content[0].text) and out.stop_reason == "end_turn"


def test_gemini_response_schema_and_json_schema(served):
    base, engine = served
    client = genai.Client(api_key="unused", http_options=types.HttpOptions(base_url=base, api_version="v1beta"))
    for config in (
        types.GenerateContentConfig(response_mime_type="application/json", response_schema=Verdict, temperature=0),
        types.GenerateContentConfig(
            response_mime_type="application/json", response_json_schema=VERDICT_SCHEMA, temperature=0
        ),
    ):
        config.max_output_tokens = 32
        out = client.models.generate_content(model=engine.model_name, contents=QUESTION, config=config)
        assert Verdict.model_validate_json(out.text)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/completions", {"guided_choice": ["a"]}, "guided_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a{"}}, "regex"),
        ("/v1/chat/completions", {"structured_outputs": {"json": {"type": "wrong"}}}, "json"),
        ("/v1/completions", {"structured_outputs": {"grammar": "start: undefined_rule"}}, "grammar"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "schema": 7}}}, "text.format.schema"),
        ("/v1/messages", {"output_config": {"format": {"type": "yaml"}}}, "output_format"),
    ],
)
def test_bad_constraints_are_400s_that_name_the_field(served, path, body, param):
    base, engine = served
    full = {"model": engine.model_name, "max_tokens": 4, **body}
    if path == "/v1/completions":
        full["prompt"] = "hi"
    elif path == "/v1/responses":
        full = {"model": engine.model_name, "input": "hi", **body}
    else:
        full["messages"] = [{"role": "user", "content": "hi"}]
    answer = httpx.post(base + path, json=full, timeout=60)
    assert answer.status_code == 400 and param in answer.text, answer.text
    ok = httpx.post(base + "/v1/completions", json={"model": engine.model_name, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # the server keeps serving
