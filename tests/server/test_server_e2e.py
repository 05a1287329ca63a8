"""The server end to end on the default model (fp32), driven by the official openai client over real HTTP.

One server for the whole module, in this process (uvicorn on a free port, the engine on the session's shared
weights); each test leaves it idle with no page held by a request, and checks that itself where it matters. The
real `python -m prefixkv.server` process is started by test_server_shutdown.py, which checks that it serves the
same (its key enforced, the in-process LLM's greedy text) before it sends that process SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio

import httpx
import openai
import pytest

from prefixkv.sampling_params import SamplingParams
from tests.server.live_server import cache_summary, running_server, wait_no_pages_held

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite colour is",
    "The quick brown fox",
    "In 1492, Columbus",
    "To make a cake you need",
    "The sun is a",
]
SYSTEM = (
    "You are a meticulous assistant for a small bakery. You answer questions about opening hours, "
    "ingredients, allergens, prices and custom orders. Keep every answer short, friendly and accurate, "
    "and never invent products that the bakery does not sell."
)


@pytest.fixture(scope="module")
def server(new_engine):
    """What `python -m prefixkv.server --api-key KEY` serves (default options), run in this process on the shared
    weights; test_server_shutdown.py starts the real command."""
    with running_server(new_engine(), api_key=KEY) as (base, _, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _summary(base: str) -> dict:
    return cache_summary(base, AUTH)


def _wait_no_pages_held(base: str, timeout: float = 20.0) -> dict:
    return wait_no_pages_held(base, AUTH, timeout)


def test_greedy_http_matches_llm_generate(client, model, llm_factory):
    """fp32 greedy text over HTTP (completions and chat) equals the in-process LLM's."""
    llm = llm_factory(prefix_cache="off")  # the engine tests build this one too; the server runs "hash"
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    got = client.completions.create(model=model, prompt=PROMPTS[:3], max_tokens=16, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)

    messages = [{"role": "user", "content": "Name three fruits."}]
    want = llm.chat(messages, params, use_tqdm=False)[0]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == want.outputs[0].text
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streaming_chat_with_usage(client, model):
    messages = [{"role": "user", "content": "Say hello in French."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].choices == []  # the usage chunk carries no choice
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_cached_tokens_for_repeated_system_prompt(server, client, model):
    def ask(question: str, **extra):
        return client.chat.completions.create(
            model=model,
            max_tokens=4,
            temperature=0,
            extra_body=extra or None,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )

    first = ask("When do you open?")
    assert first.usage.prompt_tokens > 32
    second = ask("Do you sell rye bread?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    salted = ask("Do you sell rye bread?", cache_salt="another-tenant")
    assert salted.usage.prompt_tokens_details.cached_tokens == 0

    stream = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any vegan cakes?"}],
    )
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens >= 32

    assert httpx.post(server + "/reset_prefix_cache", headers=AUTH).json() == {"reset": True}
    assert ask("Do you sell rye bread?").usage.prompt_tokens_details.cached_tokens == 0
    assert _summary(server)["hit_rate"] > 0


def test_64_concurrent_streams(server, client, model):
    """Many connections, one engine: all finish with the sequential greedy text, and no page stays held."""
    reference = {
        p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in PROMPTS
    }  # one at a time
    before = httpx.get(server + "/metrics", headers=AUTH).text
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(prompt: str, sem: asyncio.Semaphore) -> tuple[str, str, str | None]:
        async with sem:
            stream = await aclient.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True
            )
            parts, finish = [], None
            async for chunk in stream:
                for choice in chunk.choices:
                    parts.append(choice.text)
                    finish = choice.finish_reason or finish
            return prompt, "".join(parts), finish

    async def main():
        sem = asyncio.Semaphore(64)
        try:
            return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)], sem) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, text, finish in results:
        assert finish in ("stop", "length")
        assert text == reference[prompt], prompt
    _wait_no_pages_held(server)

    def done_count(metrics: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("prefixkv:request_success_total{")
        )

    after = httpx.get(server + "/metrics", headers=AUTH).text
    assert done_count(after) - done_count(before) >= 64
    assert f'prefixkv:kv_pages_used{{model_name="{model}"}} 0.0' in after
    assert "prefixkv:time_to_first_token_seconds_count" in after
    assert "prefixkv:prefix_cache_hits_total" in after


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{oops", 400, None),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
        ("/v1/completions", {"prompt": "hello " * 9000}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.2}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}, {"content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ],
)
def test_bad_input_then_good(server, client, model, path, body, status, param):
    r = httpx.post(
        server + path, headers=AUTH, timeout=60, **({"content": body} if isinstance(body, bytes) else {"json": body})
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_disconnect_aborts_and_frees_pages(server):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection
        for line in lines:
            if line.startswith("data: {"):
                break
        assert _summary(server)["kv_pages_used"] > 0
    _wait_no_pages_held(server)
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    assert 'finished_reason="abort"' in metrics


def test_api_key_enforced(server):
    assert httpx.get(server + "/health").status_code == 200
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/cache/summary"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/completions"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):  # none, wrong, no scheme
            r = httpx.request(method, server + path, json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()


def test_bench_client_against_server(server):
    from prefixkv.bench.serve_client import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    res = run(
        p.parse_args(
            [
                "--base-url",
                server,
                "--api-key",
                KEY,
                "--num-requests",
                "4",
                "--concurrency",
                "2",
                "--system-prompt-tokens",
                "64",
                "--output-tokens",
                "4",
                "--ignore-eos",
            ]
        )
    )
    assert res["num_ok"] == 4 and res["output_tokens"] == 16
    assert res["cached_tokens"] > 0 and res["ttft_ms"]["p99"] > 0
