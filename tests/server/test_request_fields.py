"""Every field a client sends is honoured or refused (issue 41 part 4), on a real server.

The request parameters of the pinned SDKs (openai 3.63.0, anthropic 2.15.0 and its beta messages, google-genai
3.6.1's GenerateContentConfig) are each in their body's table (request_fields.py): a field of the request model,
accepted with no effect, or refused. Then, against the server: an unknown field is a 400 in each API's own
shape and words; every refused field is a 400 naming it, and passes with a neutral value; every no-effect field
is accepted; penalties and logit_bias reach the sampler through the official client.
"""

from __future__ import annotations

import inspect
import typing
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import message_count_tokens_params as beta_count_params
from anthropic.types.beta import message_create_params as beta_create_params
from google.genai import types as genai_types
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from prefixkv.server import field_docs
from prefixkv.server.gemini_protocol import GenerateContentRequest, GenerationConfig
from prefixkv.server.messages_protocol import CountTokensRequest, MessagesRequest
from prefixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from prefixkv.server.request_fields import TableFields
from prefixkv.server.responses_protocol import ResponsesRequest
from prefixkv.server.tokenize import DetokenizeRequest, TokenizeRequest
from tests.server.live_server import running_server

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "Hi"}]
# the SDK's own arguments (how it sends, not what): never on the wire
CLIENT_SIDE = {"extra_headers", "extra_query", "extra_body", "timeout", "self"}
GEMINI_CLIENT_SIDE = {"http_options", "should_return_http_response", "automatic_function_calling"}
GEMINI_CLIENT_SIDE |= {"automatic_continuation"}


def _params(method, typed_dict) -> set[str]:
    """A create method's parameters and its TypedDict's keys (the wire names): the two are walked together."""
    return (set(inspect.signature(method).parameters) | set(typing.get_type_hints(typed_dict))) - CLIENT_SIDE


def _sdk_bodies() -> list[tuple[str, set[str], type[TableFields]]]:
    oa = openai.OpenAI(api_key="x")
    an = anthropic.Anthropic(api_key="x")
    return [
        (
            "chat",
            _params(oa.chat.completions.create, chat_create_params.CompletionCreateParamsBase),
            ChatCompletionRequest,
        ),
        (
            "completions",
            _params(oa.completions.create, completion_create_params.CompletionCreateParamsBase),
            CompletionRequest,
        ),
        ("responses", _params(oa.responses.create, response_create_params.ResponseCreateParamsBase), ResponsesRequest),
        ("messages", _params(an.messages.create, message_create_params.MessageCreateParamsBase), MessagesRequest),
        ("beta messages", set(typing.get_type_hints(beta_create_params.MessageCreateParamsBase)), MessagesRequest),
        (
            "count_tokens",
            _params(an.messages.count_tokens, message_count_tokens_params.MessageCountTokensParams),
            CountTokensRequest,
        ),
        (
            "beta count_tokens",
            set(typing.get_type_hints(beta_count_params.MessageCountTokensParams)),
            CountTokensRequest,
        ),
    ]


def _kind(model: type[TableFields], name: str) -> str | None:
    table = model.FIELDS
    spelled = table.spell(name)
    fields = {table.spell(f.alias or n) for n, f in model.model_fields.items()}
    kinds = [
        k
        for k, hit in (
            ("honoured", spelled in fields),
            ("no effect", spelled in table.no_effect),
            ("refused", spelled in table.refused),
        )
        if hit
    ]
    assert len(kinds) <= 1, f"{model.__name__}.{name} is {' and '.join(kinds)}"
    return kinds[0] if kinds else None


@pytest.mark.parametrize(
    "api", ["chat", "completions", "responses", "messages", "beta messages", "count_tokens", "beta count_tokens"]
)
def test_every_pinned_sdk_parameter_is_honoured_or_accounted_for(api):
    ((names, model),) = [(names, model) for title, names, model in _sdk_bodies() if title == api]
    missing = sorted(name for name in names if _kind(model, name) is None)
    assert not missing, f"{api}: the SDK sends {missing}, which the table does not list"


def test_every_gemini_config_field_is_honoured_or_accounted_for():
    """GenerateContentConfig mixes the request's top-level fields and generationConfig's: each is in one."""
    missing = []
    for name in set(genai_types.GenerateContentConfig.model_fields) - GEMINI_CLIENT_SIDE:
        kinds = [_kind(GenerateContentRequest, name), _kind(GenerationConfig, name)]
        if kinds == [None, None]:
            missing.append(name)
    assert not missing, f"google-genai sends {sorted(missing)}, which no table lists"


def test_docs_list_every_field_as_the_tables_say():
    assert field_docs.written(field_docs.DOC.read_text()) == field_docs.DOC.read_text(), (
        "docs/server.md's field table is stale: python -m prefixkv.server.field_docs --write"
    )


# -- against the server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(llm_factory):
    with running_server(llm_factory(kv_cache_tokens=4096).llm_engine) as (url, _, _app):
        yield url


ROUTES = {  # a minimal valid body per route, and where its generation fields go
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}, ChatCompletionRequest),
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, CompletionRequest),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1}, ResponsesRequest),
    "messages": ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 1}, MessagesRequest),
    "count_tokens": ("/v1/messages/count_tokens", {"model": MODEL, "messages": USER}, CountTokensRequest),
    "gemini": (
        f"/v1beta/models/{MODEL}:generateContent",
        {"contents": [{"parts": [{"text": "Hi"}]}], "generationConfig": {"maxOutputTokens": 1}},
        GenerateContentRequest,
    ),
    "tokenize": ("/tokenize", {"prompt": "Hi"}, TokenizeRequest),
    "detokenize": ("/detokenize", {"tokens": [1]}, DetokenizeRequest),
}


def _post(base: str, route: str, extra: dict, config: dict | None = None) -> httpx.Response:
    path, body, _ = ROUTES[route]
    body = {**body, **extra}
    if config is not None:
        body["generationConfig"] = {**body["generationConfig"], **config}
    return httpx.post(base + path, json=body, timeout=60)


@pytest.mark.parametrize(
    "route,message",
    [
        ("chat", "Unrecognized request argument supplied: frobnicate"),
        ("completions", "Unrecognized request argument supplied: frobnicate"),
        ("responses", "Unknown parameter: 'frobnicate'."),
        ("messages", "frobnicate: Extra inputs are not permitted"),
        ("count_tokens", "frobnicate: Extra inputs are not permitted"),
        ("gemini", 'Invalid JSON payload received. Unknown name "frobnicate": Cannot find field.'),
        ("tokenize", "Unrecognized request argument supplied: frobnicate"),
    ],
)
def test_an_unknown_field_is_a_400_in_the_apis_own_words(base, route, message):
    r = _post(base, route, {"frobnicate": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == message
    assert r.json().get("type") == "error" if route in ("messages", "count_tokens") else True
    assert error.get("status", "INVALID_ARGUMENT") == "INVALID_ARGUMENT"


def test_an_unknown_nested_field_is_named_with_its_path(base):
    r = _post(base, "gemini", {}, {"frobnicate": 1})
    assert r.status_code == 400 and '"generationConfig.frobnicate"' in r.json()["error"]["message"]
    r = _post(base, "chat", {"stream": True, "stream_options": {"include_usage": True, "nope": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.nope"


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_refused_field_is_a_400_naming_it_and_passes_when_neutral(base, route):
    model = ROUTES[route][2]
    tables = [(model.FIELDS, None)] + ([(GenerationConfig.FIELDS, "config")] if route == "gemini" else [])
    neutral_posts = []  # (extra, config) of each neutral request
    for table, where in tables:
        for name, refused in table.refused.items():
            wrong = {"asks": "for it"}
            r = _post(base, route, {} if where else {name: wrong}, {name: wrong} if where else None)
            assert r.status_code == 400, (route, name, r.text)
            assert name in r.json()["error"]["message"] and refused.why in r.json()["error"]["message"]
            neutral = next(v for v in refused.neutral if v is not None) if len(refused.neutral) > 1 else None
            neutral_posts.append(({} if where else {name: neutral}, {name: neutral} if where else None))
    with ThreadPoolExecutor(8) as pool:  # the neutral ones generate: sent together, they share engine steps
        answers = pool.map(lambda post: _post(base, route, *post), neutral_posts)
        for post, r in zip(neutral_posts, answers, strict=True):
            assert r.status_code == 200, (route, post, r.text)


@pytest.mark.parametrize("route", list(ROUTES))
def test_the_no_effect_fields_are_accepted(base, route):
    model = ROUTES[route][2]
    fields = {name: True for name in model.FIELDS.no_effect}
    config = {name: True for name in GenerationConfig.FIELDS.no_effect} if route == "gemini" else None
    r = _post(base, route, fields, config)
    assert r.status_code == 200, r.text


def test_penalties_and_logit_bias_through_the_openai_client(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    plain = client.completions.create(model=MODEL, prompt="1, 2, 1, 2, 1, 2,", max_tokens=4, temperature=0)
    forced = client.completions.create(
        model=MODEL, prompt="1, 2, 1, 2, 1, 2,", max_tokens=2, temperature=0, logit_bias={"33": 100}
    )
    assert forced.choices[0].text != plain.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0, frequency_penalty=1.5, presence_penalty=0.5
    )
    assert chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="logit_bias: token id 99999999 is out of range"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, logit_bias={"99999999": 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias keys must be token ids"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, logit_bias={"hello": 1})
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, presence_penalty=3)


def test_tokenize_counts_what_the_generating_routes_prompt_and_detokenize_inverts_it(base):
    """/tokenize's count is the prompt_tokens that /v1/completions and /v1/chat/completions report for the same
    text, messages and tools; /detokenize gives the text back; the ids are the ones logit_bias takes."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    text = "The capital of France is"
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    assert done.usage is not None and r["count"] == len(r["tokens"]) == done.usage.prompt_tokens
    assert r["max_model_len"] > r["count"] and "".join(r["token_strs"]).replace("Ġ", " ") == text
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    tools = [{"type": "function", "function": {"name": "now", "description": "The time", "parameters": {}}}]
    chat = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=1)  # type: ignore[arg-type]
    r = httpx.post(base + "/tokenize", json={"messages": USER, "tools": tools}).json()
    assert chat.usage is not None and r["count"] == chat.usage.prompt_tokens and r["token_strs"] is None
    bare = httpx.post(base + "/tokenize", json={"messages": USER, "add_generation_prompt": False}).json()
    assert bare["count"] < r["count"]


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
        ("/tokenize", {"prompt": "a", "model": "other"}, None),
        ("/tokenize", {"messages": [{"role": "nobody", "content": "a"}]}, "messages"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_tokenize_refuses_bad_bodies_naming_the_field(base, route, body, param):
    r = httpx.post(base + route, json=body)
    if param is None:
        assert r.status_code == 404 and "other" in r.json()["error"]["message"]
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
