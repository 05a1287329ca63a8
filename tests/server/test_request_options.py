"""Every generating route honours every header, because every route builds its RequestOptions through the one
builder (server/request_options.py): each route x each header, checked on the options the engine received. A bad
header is a 400 on each route, and nothing reaches the engine.
"""

from __future__ import annotations

import httpx
import pytest

from prefixkv.request_options import RequestOptions
from prefixkv.session_hint import SessionHint
from tests.server.live_server import running_server

HEADERS = {
    "x-session-id": "agent-7",
    "x-session-parent-id": "agent-1",
    "x-session-expected-pause-s": "12.5",
    "x-session-action": "release",
    "x-prefixkv-held-elsewhere": "16",
}
WANT_SESSION = SessionHint("agent-7", "agent-1", 12.5, "release")


def routes(model: str) -> dict[str, tuple[str, dict]]:
    """Each generating route: (path, a small body)."""
    chat = [{"role": "user", "content": "Say hi."}]
    gemini = {
        "contents": [{"role": "user", "parts": [{"text": "Say hi."}]}],
        "generationConfig": {"maxOutputTokens": 2},
    }
    return {
        "chat completions": ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 2}),
        "completions": ("/v1/completions", {"model": model, "prompt": "Say hi.", "max_tokens": 2}),
        "responses": ("/v1/responses", {"model": model, "input": "Say hi.", "max_output_tokens": 2}),
        "messages": ("/v1/messages", {"model": model, "messages": chat, "max_tokens": 2}),
        "gemini": (f"/v1beta/models/{model}:generateContent", gemini),
        "gemini stream": (f"/v1beta/models/{model}:streamGenerateContent?alt=sse", gemini),
    }


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(kv_cache_tokens=2048)
    received: list = []
    real_add = engine.add_request

    def add_request(request_id, prompt, options=None, **kwargs):
        received.append(options)
        return real_add(request_id, prompt, options, **kwargs)

    engine.add_request = add_request
    with running_server(engine) as (base, engine, _):
        yield base, engine, received


@pytest.mark.parametrize("route", list(routes("m")))
def test_every_route_honours_every_header(served, route):
    base, engine, received = served
    path, body = routes(engine.model_name)[route]
    with httpx.Client(base_url=base, timeout=60) as client:
        before = len(received)
        answer = client.post(path, json=body, headers=HEADERS)
        assert answer.status_code == 200, answer.text
        (options,) = received[before:]
        assert isinstance(options, RequestOptions)
        assert options.session == WANT_SESSION, route
        assert options.held_elsewhere_tokens == 16, route
        plain = client.post(path, json=body)  # no headers: none of it
        assert plain.status_code == 200, plain.text
        assert received[-1].session is None and received[-1].held_elsewhere_tokens == 0, route


@pytest.mark.parametrize("route", list(routes("m")))
@pytest.mark.parametrize(
    "header, value",
    [("x-session-expected-pause-s", "soon"), ("x-session-action", "forget"), ("x-prefixkv-held-elsewhere", "-3")],
)
def test_a_bad_header_is_a_400_on_every_route(served, route, header, value):
    base, engine, received = served
    path, body = routes(engine.model_name)[route]
    before = len(received)
    answer = httpx.post(base + path, json=body, headers={"x-session-id": "a", header: value}, timeout=60)
    assert answer.status_code == 400 and header in answer.text, (route, answer.text)
    assert len(received) == before  # refused before the engine saw anything
