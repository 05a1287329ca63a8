"""The server's plumbing over real HTTP, with a model-free engine: engine thread, SSE, aborts, errors, auth.

Fast (no model); the same behaviours on the real model are covered by test_server_e2e.py.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.fake_engine import FakeEngine, expected_text
from tests.server.fake_server import running_fake_server


@pytest.fixture(scope="module")
def server():
    with running_fake_server(FakeEngine(), api_key="sekret", tenant_isolation="api-key") as s:
        yield s


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)


def _post(base: str, path: str, body, key: str | None = "sekret") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(base + path, content=content, headers={**headers, "Content-Type": "application/json"})


def _wait_idle(engine: FakeEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()


def test_completion_multi_prompt_and_n(server):
    base, engine, _ = server
    out = _client(base).completions.create(model="fake-model", prompt=["ab", [104, 105]], max_tokens=5, n=2,
                                           temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == expected_text(list(b"ab"), 5, 0)
    assert out.choices[1].text == expected_text(list(b"ab"), 5, 1)
    assert out.choices[2].text == expected_text([104, 105], 5, 0)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_chat_and_usage(server):
    base, engine, _ = server
    stream = _client(base).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == expected_text(list(prompt.encode()), 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_tenant_salt_and_extensions_reach_engine(server):
    base, engine, _ = server
    _client(base).completions.create(model="fake-model", prompt="x", max_tokens=1,
                                     extra_body={"cache_salt": "s1", "priority": 3})
    added = engine.added[-1]
    assert added["priority"] == 3
    assert added["cache_salt"] not in (None, "s1")  # bound to the API key's tenant, hashed


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ([1, 2], 400, None),
    ({"model": "fake-model"}, 400, "prompt"),
    ({"model": "fake-model", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "fake-model", "prompt": "x" * 300}, 400, "prompt"),
    ({"model": "fake-model", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "fake-model", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": "fake-model", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "fake-model", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "fake-model", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "fake-model", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "fake-model", "prompt": [999]}, 400, "prompt"),
    ({"model": "fake-model", "prompt": []}, 400, "prompt"),
])
def test_bad_completion_inputs(server, body, status, param):
    base, engine, _ = server
    r = _post(base, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    ok = _post(base, "/v1/completions", {"model": "fake-model", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}], [{"role": "wizard", "content": "x"}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}], "hello"])
def test_bad_chat_messages(server, messages):
    base, _, _ = server
    r = _post(base, "/v1/chat/completions", {"model": "fake-model", "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"


def test_api_key_enforced(server):
    base, _, _ = server
    assert httpx.get(base + "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/cache/summary"):
        r = httpx.get(base + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(base + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert _post(base, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_stream_disconnect_aborts(server):
    base, engine, _ = server
    engine.step_delay = 0.02
    try:
        with httpx.stream("POST", base + "/v1/completions", headers={"Authorization": "Bearer sekret"},
                          json={"prompt": "long", "max_tokens": 200, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        _wait_idle(engine)
        assert engine.aborted, "closing the stream must abort the engine request"
        assert engine.pages_used() == 0
    finally:
        engine.step_delay = 0.002


def test_non_stream_disconnect_aborts(server):
    base, engine, _ = server
    engine.step_delay = 0.02
    before = len(engine.aborted)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer sekret"},
                       json={"prompt": "long", "max_tokens": 200}, timeout=0.3)
        _wait_idle(engine)
        assert len(engine.aborted) == before + 1
    finally:
        engine.step_delay = 0.002


def test_concurrent_streams_batch_and_metrics(server):
    base, engine, _ = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)

    async def one(i: int) -> tuple[str, str]:
        prompt = f"prompt {i}"
        stream = await client.completions.create(model="fake-model", prompt=prompt, max_tokens=8, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        return prompt, text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    for prompt, text in asyncio.run(main()):
        assert text == expected_text(list(prompt.encode()), 8)
    _wait_idle(engine)
    metrics = httpx.get(base + "/metrics", headers={"Authorization": "Bearer sekret"}).text
    assert 'prefixkv:kv_pages_used{model_name="fake-model"} 0.0' in metrics
    assert "prefixkv:time_to_first_token_seconds_count" in metrics
    assert 'prefixkv:request_success_total{finished_reason="length",model_name="fake-model"}' in metrics
    summary = httpx.get(base + "/cache/summary", headers={"Authorization": "Bearer sekret"}).json()
    assert summary["kv_pages_used"] == 0 and "hit_rate" in summary


def test_engine_step_failure_fails_requests_not_server(server):
    base, engine, _ = server
    engine.fail_steps = 1
    r = _post(base, "/v1/completions", {"prompt": "boom", "max_tokens": 3})
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    _wait_idle(engine)
    ok = _post(base, "/v1/completions", {"prompt": "fine", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected_text(list(b"fine"), 3)
