"""Google's Gemini API through the unmodified google-genai SDK (pinned in pyproject.toml) against the real app:
generate_content and its usage (cachedContentTokenCount: what the prefix cache served), the SSE stream, count_tokens,
cachedContents created, read, listed, extended, used and deleted, tenant isolation on every route, bad input
answered as Gemini's errors (the SDK's ClientError with code and status) while a request in flight finishes, the
model methods at the SDK's default api_version (v1) beside OpenAI's /v1, and the model listed and got. One server
for the module on the suite's shared weights; tiny answers."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from google import genai
from google.genai import errors, types

from tests.server.live_server import running_server

KEY_FILE = "alice-key alice\nbob-key bob\n"
PAGE = 16  # the hash cache's default page size


@pytest.fixture(scope="module")
def served(new_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    engine = new_engine(kv_cache_tokens=4096, retained_pool_fraction=0.25)
    with running_server(engine, api_key_file=str(path)) as (base, engine, _):
        yield base, engine.model_name


_CLIENTS: dict = {}  # held: a genai.Client closes its connection pool when it is collected


def client(served, key: str = "alice-key") -> genai.Client:
    if (served[0], key) not in _CLIENTS:
        options = types.HttpOptions(base_url=served[0], api_version="v1beta", timeout=60_000)
        _CLIENTS[served[0], key] = genai.Client(api_key=key, http_options=options)
    return _CLIENTS[served[0], key]


def config(max_tokens: int = 2, **kw) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(temperature=0, max_output_tokens=max_tokens, **kw)


def rules(words: int = 24) -> str:
    """A system instruction of its own (a tag up front), a few pages long."""
    return f"[{uuid.uuid4().hex[:8]}] You are terse. " + " ".join(f"Rule {i}." for i in range(words))


def test_generate_content_and_its_usage(served):
    system = rules()
    first = client(served).models.generate_content(
        model=served[1], contents="Hi", config=config(system_instruction=system)
    )
    usage = first.usage_metadata
    assert usage.cached_content_token_count == 0 and usage.prompt_token_count > 3 * PAGE
    assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count
    candidate = first.candidates[0]
    assert candidate.content.role == "model" and candidate.finish_reason in ("STOP", "MAX_TOKENS")
    assert first.text is not None and first.model_version == served[1] and first.response_id

    again = client(served).models.generate_content(
        model="models/" + served[1], contents="Hello", config=config(system_instruction=system)
    )  # the same system instruction, read from the cache
    assert again.usage_metadata.cached_content_token_count >= 3 * PAGE


def test_the_stream_joins_to_the_plain_answer_and_counts_tokens(served):
    contents = [
        types.Content(role="user", parts=[types.Part(text="Name a colour.")]),
        types.Content(role="model", parts=[types.Part(text="Blue.")]),
        types.Content(role="user", parts=[types.Part(text="Another?")]),
    ]
    gemini = client(served)
    plain = gemini.models.generate_content(model=served[1], contents=contents, config=config(6))
    chunks = list(gemini.models.generate_content_stream(model=served[1], contents=contents, config=config(6)))
    assert len(chunks) > 1 and "".join(c.text or "" for c in chunks) == plain.text
    assert all(c.usage_metadata is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.candidates[0].finish_reason == plain.candidates[0].finish_reason
    assert last.usage_metadata.prompt_token_count == plain.usage_metadata.prompt_token_count
    assert last.usage_metadata.candidates_token_count == plain.usage_metadata.candidates_token_count
    counted = gemini.models.count_tokens(model=served[1], contents=contents)
    assert counted.total_tokens == plain.usage_metadata.prompt_token_count


def test_a_cached_content_created_used_extended_and_deleted(served):
    gemini = client(served)
    made = gemini.caches.create(
        model=served[1],
        config=types.CreateCachedContentConfig(
            system_instruction=rules(), contents=["Remember: the code is 42."], ttl="300s", display_name="rules"
        ),
    )
    total = made.usage_metadata.total_token_count
    assert made.name.startswith("cachedContents/") and made.model == "models/" + served[1]
    assert made.display_name == "rules" and total > 2 * PAGE
    assert abs((made.expire_time - datetime.now(UTC)).total_seconds() - 300) < 30
    assert gemini.caches.get(name=made.name).expire_time == made.expire_time
    assert made.name in [c.name for c in gemini.caches.list(config={"page_size": 100})]

    used = gemini.models.generate_content(
        model=served[1], contents="What is the code?", config=config(cached_content=made.name)
    )  # served on top of it: its messages, then the request's
    assert used.usage_metadata.prompt_token_count > total
    assert used.usage_metadata.cached_content_token_count >= total // PAGE * PAGE
    chat = httpx.post(  # the same entry on the OpenAI route, by its Gemini name
        served[0] + "/v1/chat/completions",
        headers={"Authorization": "Bearer alice-key"},
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "cached_content": made.name},
        timeout=60,
    )
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= total // PAGE * PAGE

    longer = gemini.caches.update(name=made.name, config=types.UpdateCachedContentConfig(ttl="900s"))
    assert longer.expire_time > made.expire_time and longer.update_time >= longer.create_time
    when = (datetime.now(UTC) + timedelta(seconds=120)).replace(microsecond=0)
    shorter = gemini.caches.update(name=made.name, config=types.UpdateCachedContentConfig(expire_time=when))
    assert shorter.expire_time == when

    gemini.caches.delete(name=made.name)
    with pytest.raises(errors.ClientError) as gone:
        gemini.caches.get(name=made.name)
    assert gone.value.code == 404 and gone.value.status == "NOT_FOUND"
    with pytest.raises(errors.ClientError) as unusable:
        gemini.models.generate_content(model=served[1], contents="Hi", config=config(cached_content=made.name))
    assert unusable.value.code == 400 and unusable.value.status == "INVALID_ARGUMENT"


def test_tenants_see_and_use_only_their_own_cached_contents(served):
    alice, bob = client(served), client(served, "bob-key")
    made = alice.caches.create(
        model=served[1], config=types.CreateCachedContentConfig(system_instruction=rules(8), ttl="600s")
    )
    attempts = (
        lambda: bob.caches.get(name=made.name),
        lambda: bob.caches.update(name=made.name, config=types.UpdateCachedContentConfig(ttl="5s")),
        lambda: bob.caches.delete(name=made.name),
    )
    for attempt in attempts:
        with pytest.raises(errors.ClientError) as info:
            attempt()
        assert info.value.code == 404 and info.value.status == "NOT_FOUND"
    assert made.name not in [c.name for c in bob.caches.list()]
    with pytest.raises(errors.ClientError) as used:
        bob.models.generate_content(model=served[1], contents="Hi", config=config(cached_content=made.name))
    assert used.value.code == 400 and used.value.status == "INVALID_ARGUMENT"
    mine = alice.caches.get(name=made.name)  # alice lost nothing
    assert mine.expire_time == made.expire_time and mine.usage_metadata == made.usage_metadata
    with pytest.raises(errors.ClientError) as stranger:
        client(served, "nobody").models.count_tokens(model=served[1], contents="Hi")
    assert stranger.value.code == 401 and stranger.value.status == "UNAUTHENTICATED"


def test_bad_input_gets_gemini_errors_while_another_request_finishes(served):
    gemini = client(served)
    streamed: list = []
    in_flight = threading.Thread(
        target=lambda: streamed.extend(
            gemini.models.generate_content_stream(model=served[1], contents="Count to ten.", config=config(24))
        )
    )
    in_flight.start()
    image = types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")
    bad = [
        (dict(contents=[image]), "got 'inlineData'"),
        (dict(contents="Hi", config=config(candidate_count=2)), "candidateCount"),
        (dict(contents="Hi", config=config(cached_content="cachedContents/cache_none")), "not found"),
        (dict(contents="Hi", config=config(response_mime_type="text/csv")), "responseMimeType"),
        (dict(contents="Hi", config=config(response_json_schema={"type": "nonsense"})), "responseJsonSchema"),
    ]
    for kwargs, message in bad:
        with pytest.raises(errors.ClientError, match=message) as info:
            gemini.models.generate_content(model=served[1], **kwargs)
        assert info.value.code == 400 and info.value.status == "INVALID_ARGUMENT"
    with pytest.raises(errors.ClientError) as missing:
        gemini.models.generate_content(model="gemini-9-ultra", contents="Hi")
    assert missing.value.code == 404 and missing.value.status == "NOT_FOUND"
    raw = [  # what the SDK would not send: the server's own validation, in Gemini's shape too
        (":generateContent", {"contents": [{"role": "assistant", "parts": [{"text": "a"}]}]}),
        (":generateContent", {"contents": [], "generationConfig": {"temperature": "hot"}}),
        (":streamGenerateContent", {"contents": [{"parts": [{"text": "a"}]}]}),  # no ?alt=sse
    ]
    for method, body in raw:
        r = httpx.post(
            f"{served[0]}/v1beta/models/{served[1]}{method}", json=body, headers={"x-goog-api-key": "alice-key"}
        )
        error = r.json()["error"]
        assert r.status_code == 400 and set(error) == {"code", "message", "status"}, r.text
        assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    in_flight.join(60)
    assert streamed and streamed[-1].candidates[0].finish_reason in ("STOP", "MAX_TOKENS")
    assert streamed[-1].usage_metadata.candidates_token_count > 0


def test_the_sdk_at_its_default_api_version_v1(served, monkeypatch):
    """No api_version set: the model methods under /v1, errors in Gemini's shape there, OpenAI's /v1 untouched."""
    monkeypatch.delenv("GOOGLE_GENAI_API_VERSION", raising=False)
    gemini = genai.Client(api_key="alice-key", http_options={"base_url": served[0], "timeout": 60_000})
    contents = "Name a colour."
    plain = gemini.models.generate_content(model=served[1], contents=contents, config=config(4))
    chunks = list(gemini.models.generate_content_stream(model=served[1], contents=contents, config=config(4)))
    assert "".join(c.text or "" for c in chunks) == plain.text
    counted = gemini.models.count_tokens(model=served[1], contents=contents)
    assert counted.total_tokens == plain.usage_metadata.prompt_token_count
    assert chunks[-1].usage_metadata.prompt_token_count == counted.total_tokens
    with pytest.raises(errors.ClientError, match="API version v1;") as missing:  # the v1 path served it
        gemini.models.generate_content(model="gemini-9-ultra", contents=contents)
    assert missing.value.code == 404 and missing.value.status == "NOT_FOUND"
    alice = {"x-goog-api-key": "alice-key"}
    bad = httpx.post(f"{served[0]}/v1/models/{served[1]}:countTokens", json={"contents": []}, headers=alice)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"code", "message", "status"}, bad.text
    openai = httpx.get(served[0] + "/v1/models", headers=alice)  # still OpenAI's list, its errors OpenAI's
    assert openai.json()["data"][0]["id"] == served[1]
    chat = httpx.post(served[0] + "/v1/chat/completions", json={}, headers=alice)
    assert chat.status_code == 400 and set(chat.json()["error"]) == {"message", "type", "param", "code"}


def test_the_model_listed_and_got(served):
    gemini = client(served)
    (listed,) = list(gemini.models.list())
    card = httpx.get(served[0] + "/v1/models", headers={"x-goog-api-key": "alice-key"}).json()["data"][0]
    assert listed.name == "models/" + served[1] and listed.display_name == served[1]
    assert listed.input_token_limit == listed.output_token_limit == card["max_model_len"] - 1
    assert {"generateContent", "countTokens", "createCachedContent"} <= set(listed.supported_actions)
    got = gemini.models.get(model=served[1])
    assert got.model_dump(exclude={"sdk_http_response"}) == listed.model_dump(exclude={"sdk_http_response"})
    with pytest.raises(errors.ClientError) as missing:
        gemini.models.get(model="gemini-9-ultra")
    assert missing.value.code == 404 and missing.value.status == "NOT_FOUND"


def test_openapi_declares_the_routes_and_their_gemini_errors(served):
    schema = httpx.get(served[0] + "/openapi.json").json()
    error = schema["components"]["schemas"]["GeminiErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == {"code", "message", "status"}

    def error_ref(path: str, status: str, method: str = "post") -> str:
        return schema["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]["$ref"]

    for path in ("/v1beta/models/{model}:generateContent", "/v1/models/{model}:countTokens", "/v1beta/cachedContents"):
        for status in ("400", "401", "404", "413"):
            assert error_ref(path, status) == "#/components/schemas/GeminiErrorResponse", (path, status)
    for version in ("v1beta", "v1"):
        stream = schema["paths"][f"/{version}/models/{{model}}:streamGenerateContent"]["post"]["responses"]["200"]
        assert "text/event-stream" in stream["content"]
    assert error_ref("/v1beta/models/{model}", "404", "get") == "#/components/schemas/GeminiErrorResponse"
    assert error_ref("/v1/models", "401", "get") == "#/components/schemas/ErrorResponse"  # OpenAI's, beside v1's
    assert set(schema["paths"]["/v1beta/cachedContents/{cache_id}"]) == {"get", "patch", "delete"}


def test_logprobs_plain_and_streamed(served):
    """responseLogprobs: each generated token's logprob (chosenCandidates), `logprobs` alternatives each (greedy:
    the chosen token first), avgLogprobs their mean; the stream's chunks carry the same tokens; logprobs alone
    is Gemini's 400."""
    gemini = client(served)
    asked = config(6, response_logprobs=True, logprobs=2)
    plain = gemini.models.generate_content(model=served[1], contents="Name three fruits.", config=asked)
    candidate = plain.candidates[0]
    chosen = candidate.logprobs_result.chosen_candidates
    assert len(chosen) == plain.usage_metadata.candidates_token_count
    assert "".join(c.token for c in chosen) == plain.text
    tops = candidate.logprobs_result.top_candidates
    assert len(tops) == len(chosen) and all(
        len(t.candidates) == 2 and t.candidates[0].token_id == c.token_id for t, c in zip(tops, chosen, strict=True)
    )
    assert candidate.avg_logprobs == pytest.approx(sum(c.log_probability for c in chosen) / len(chosen))
    chunks = list(gemini.models.generate_content_stream(model=served[1], contents="Name three fruits.", config=asked))
    streamed = [c for chunk in chunks for c in chunk.candidates[0].logprobs_result.chosen_candidates or []]
    assert [c.token_id for c in streamed] == [c.token_id for c in chosen]
    assert chunks[-1].candidates[0].avg_logprobs is not None
    bare = gemini.models.generate_content(model=served[1], contents="Name three fruits.", config=config(6))
    assert bare.candidates[0].logprobs_result is None and bare.text == plain.text
    with pytest.raises(errors.ClientError) as err:
        gemini.models.generate_content(model=served[1], contents="x", config=config(1, logprobs=2))
    assert err.value.code == 400 and "responseLogprobs" in err.value.message
