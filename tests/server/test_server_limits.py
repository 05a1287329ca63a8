"""What one connection or client may cost the server (issue 9, items 3, 4 and 10), on the real engine.

In-process (tests/server/live_server.py) so a test can see what the engine was handed; every server here is
built by the same make_server() as `prefixkv serve`, with limits lowered through ServerLimits so the deadlines
pass in a second or two. Raw sockets play the clients the official client cannot be: half a header, a stalled
body, a reader that never reads. Timings are printed for the report, never asserted; deadlines only guard
against hangs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from prefixkv.outputs import CompletionOutput, RequestOutput
from prefixkv.server.async_engine import RequestGroup
from prefixkv.server.limits import ServerLimits
from tests.server.live_server import running_server, wait_no_pages_held

NO_AUTH: dict = {}
HANG_GUARD = 60.0


@pytest.fixture(scope="module")
def engine(new_engine):
    return new_engine(kv_cache_tokens=4096)


@pytest.fixture
def recorded(engine, monkeypatch):
    """Every prompt the engine is handed, and the thread each text is tokenized on."""
    prompts: list = []
    encode_threads: list[tuple[int, str]] = []
    real_add, real_encode = engine.add_request, engine.tokenizer.encode

    def add_request(request_id, prompt, sampling_params=None, **kwargs):
        prompts.append(prompt)
        return real_add(request_id, prompt, sampling_params, **kwargs)

    def encode(text):
        encode_threads.append((len(text), threading.current_thread().name))
        return real_encode(text)

    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    return prompts, encode_threads


def _prompt_chars(prompt) -> int:
    if isinstance(prompt, dict):
        return len(prompt.get("prompt") or "") + len(prompt.get("prompt_token_ids") or ())
    return len(prompt)


class _Stream(threading.Thread):
    """A streaming completion read by the official client; records when each chunk arrived."""

    def __init__(self, base: str, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD)
        self.model, self.max_tokens = model, max_tokens
        self.arrivals: list[float] = []
        self.text, self.finish_reason, self.error = "", None, None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model,
                prompt="Once upon a time",
                stream=True,
                max_tokens=self.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.arrivals.append(time.monotonic())
                self.text += chunk.choices[0].text
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
                self.started.set()
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc
        finally:
            self.started.set()

    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    return err


# -- item 3: body size, over-long text, tokenization off the engine thread ---------------------------------------


def test_huge_body_gets_413_while_a_stream_runs(engine, recorded):
    """A 10 MB prompt (Content-Length, then chunked) is refused with 413 before the engine or the tokenizer
    sees it; a stream running meanwhile finishes normally."""
    prompts, encode_threads = recorded
    huge = json.dumps({"prompt": "x" * (10 * 10**6), "max_tokens": 1}).encode()
    with running_server(engine) as (base, _, _):
        stream = _Stream(base, engine.model_name, max_tokens=48)
        stream.start()
        assert stream.started.wait(HANG_GUARD) and stream.error is None, stream.error
        t0 = time.monotonic()
        r = httpx.post(
            base + "/v1/completions", content=huge, timeout=HANG_GUARD, headers={"Content-Type": "application/json"}
        )
        sized = time.monotonic() - t0
        err = _assert_openai_error(r, 413)
        assert err["code"] == "request_too_large" and str(8 << 20) in err["message"]

        def chunks():
            for i in range(0, len(huge), 1 << 20):
                yield huge[i : i + (1 << 20)]

        t0 = time.monotonic()
        r = httpx.post(
            base + "/v1/completions", content=chunks(), timeout=HANG_GUARD, headers={"Content-Type": "application/json"}
        )
        chunked = time.monotonic() - t0
        _assert_openai_error(r, 413)
        stream.join(HANG_GUARD)
        assert stream.error is None and stream.finish_reason == "length", stream.error
        print(
            f"\n413 after {sized:.3f}s (Content-Length), {chunked:.3f}s (chunked); running stream's largest "
            f"inter-token gap {stream.largest_gap():.3f}s over {len(stream.arrivals)} chunks"
        )
        wait_no_pages_held(base, NO_AUTH)
    assert max(_prompt_chars(p) for p in prompts) < 1000  # the engine only ever got the small stream
    assert all(n < 1000 for n, _ in encode_threads)  # and the huge text was never tokenized


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_overlong_text_refused_before_tokenizing(engine, recorded, path):
    """Text under the body limit but longer than any prompt that could fit the context: a 400 naming the
    field, without tokenizing it. Text that tokenizes past the context: a 400 before the engine gets it."""
    prompts, encode_threads = recorded
    with running_server(engine) as (base, _, app):
        limit = app.state.server.max_prompt_chars
        text = "word " * (limit // 5 + 1)
        body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
        r = httpx.post(base + path, json=body, timeout=HANG_GUARD)
        param = "prompt" if "chat" not in path else "messages"
        err = _assert_openai_error(r, 400, param)
        assert err["code"] == "context_length_exceeded" and str(limit) in err["message"]
        assert encode_threads == []

        # short enough to tokenize (in the worker), too many tokens: refused before the engine thread sees them
        text = "hello " * (engine.max_model_len + 10)
        body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
        err = _assert_openai_error(httpx.post(base + path, json=body, timeout=HANG_GUARD), 400, param)
        assert err["code"] == "context_length_exceeded" and "max_model_len" in err["message"]
        assert [name for _, name in encode_threads] == ["prefixkv-tokenizer_0"]
        wait_no_pages_held(base, NO_AUTH)
    assert prompts == []


def test_prompts_are_tokenized_off_the_engine_thread(engine, recorded):
    """Text prompts (completions and chat) reach the engine as token ids, tokenized in a worker thread
    (greedy equality with transformers through the server is checked by test_server_e2e.py)."""
    prompts, encode_threads = recorded
    with running_server(engine) as (base, _, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD)
        out = client.completions.create(
            model=engine.model_name, prompt="The capital of France is", max_tokens=4, temperature=0
        )
        chat = client.chat.completions.create(
            model=engine.model_name, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Hi!"}]
        )
    threads = {name for _, name in encode_threads}
    assert len(encode_threads) == 2 and threads == {"prefixkv-tokenizer_0"}, encode_threads
    completion_prompt, chat_prompt = prompts  # text keeps its ids and text; chat needs only ids
    assert isinstance(completion_prompt, dict) and completion_prompt["prompt_token_ids"], prompts
    assert isinstance(chat_prompt, list) and all(isinstance(t, int) for t in chat_prompt), prompts
    assert prompts[0]["prompt_token_ids"] == engine.tokenizer.encode("The capital of France is")
    assert out.choices[0].text and out.usage.completion_tokens == 4
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4


# -- item 4: slowloris --------------------------------------------------------------------------------------------


def _closed_within(sock: socket.socket, timeout: float) -> tuple[bool, bytes]:
    """Read until the server closes (b"" or a reset); False when it is still open after timeout."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True, data
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        return True, data
    except TimeoutError:
        return False, data


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=HANG_GUARD)


def test_half_headers_are_closed_and_health_still_answers(engine):
    limits = ServerLimits(header_timeout=1.0, timeout_keep_alive=30.0)
    with running_server(engine, limits=limits) as (base, _, _):
        stalled = []
        for _ in range(20):
            s = _connect(base)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            stalled.append(s)
        # a keep-alive connection whose second request stalls mid-header is closed too
        keep_alive = _connect(base)
        keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in keep_alive.recv(65536)
        keep_alive.sendall(b"GET /health HTTP/1.1\r\nHo")
        stalled.append(keep_alive)

        t0 = time.monotonic()
        assert httpx.get(base + "/health", timeout=HANG_GUARD).json() == {"status": "ok"}  # while they are open
        results = [_closed_within(s, HANG_GUARD) for s in stalled]
        waited = time.monotonic() - t0
        for s in stalled:
            s.close()
        assert all(closed for closed, _ in results), "a stalled connection is still open"
        assert httpx.get(base + "/health", timeout=HANG_GUARD).json() == {"status": "ok"}
        print(f"\n21 half-header connections all closed {waited:.2f}s after /health answered (header timeout 1s)")


def test_stalled_body_gets_408(engine):
    limits = ServerLimits(body_timeout=1.0)
    with running_server(engine, limits=limits) as (base, _, _):
        s = _connect(base)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": "Hel'
        )
        closed, data = _closed_within(s, HANG_GUARD)
        s.close()
        assert closed, "a stalled body kept its connection open"
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data
        assert b"connection: close" in head.lower()
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and set(err) == {"message", "type", "param", "code"}
        assert httpx.get(base + "/health", timeout=HANG_GUARD).json() == {"status": "ok"}


def test_connections_beyond_the_limit_get_503(engine):
    limits = ServerLimits(max_connections=5, header_timeout=30.0)
    with running_server(engine, limits=limits) as (base, _, _):
        held = [_connect(base) for _ in range(5)]
        time.sleep(0.5)  # let the server register them (ordering, not speed)
        extra = _connect(base)
        closed, data = _closed_within(extra, HANG_GUARD)
        extra.close()
        assert closed and data.startswith(b"HTTP/1.1 503"), data
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        for s in held:
            s.close()
        time.sleep(0.5)
        assert httpx.get(base + "/health", timeout=HANG_GUARD).json() == {"status": "ok"}


# -- item 10: a client that never reads --------------------------------------------------------------------------


def _abort_count(base: str, model: str) -> float:
    key = f'prefixkv:request_success_total{{finished_reason="abort",model_name="{model}"}}'
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize(
    "limits",
    [ServerLimits(stream_write_timeout=1.0), ServerLimits(max_stream_queue=8, stream_write_timeout=600.0)],
    ids=["write-timeout", "queue-cap"],
)
def test_client_that_never_reads_is_dropped(engine, limits):
    """A stream whose client never reads: the request is aborted (its pages freed) and the connection
    dropped, by the write timeout or by the queue cap; a stream beside it finishes normally."""
    with running_server(engine, limits=limits, send_buffer_bytes=4096, write_buffer_bytes=4096) as (base, _, _):
        aborts = _abort_count(base, engine.model_name)
        body = json.dumps(
            {
                "prompt": "Tell me a very long story.",
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
                "logprobs": 20,
            }
        ).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        host, port = base.removeprefix("http://").split(":")
        s.connect((host, int(port)))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        other = _Stream(base, engine.model_name, max_tokens=24)
        other.start()
        t0 = time.monotonic()
        wait_no_pages_held(base, NO_AUTH, timeout=180)
        freed = time.monotonic() - t0
        assert _abort_count(base, engine.model_name) == aborts + 1  # aborted, not finished at max_tokens
        closed, data = _closed_within(s, HANG_GUARD)
        s.close()
        assert closed and b"data: [DONE]" not in data
        other.join(HANG_GUARD)
        assert other.error is None and other.finish_reason == "length", other.error
        print(
            f"\nnon-reading client dropped, pages freed {freed:.1f}s after it stopped reading; "
            f"{len(data)} bytes were still buffered for it"
        )


def test_unread_outputs_are_coalesced():
    """The group folds the unread delta outputs of a prompt into one, and the reader still gets everything."""

    def output(rid: str, tokens: int, finished: bool = False) -> RequestOutput:  # the delta of step `tokens`
        return RequestOutput(rid, "p", [1], [CompletionOutput(0, "x", [7], "length" if finished else None)], finished)

    async def scenario() -> list[tuple[int, RequestOutput]]:
        group = RequestGroup(engine=None, request_ids=["a", "b"], max_backlog=None)  # type: ignore[arg-type]
        for step in range(1, 1001):
            group.put(0, output("a", step, finished=step == 1000))
            if step <= 10:
                group.put(1, output("b", step, finished=step == 10))
        assert len(group._unread) == 2  # two outputs held, not 1,010
        return [item async for item in group]

    got = asyncio.run(scenario())
    assert [(i, len(o.outputs[0].text), o.finished) for i, o in got] == [(0, 1000, True), (1, 10, True)]


def test_a_send_that_cannot_wait_skips_the_guard(monkeypatch):
    """A stream's send goes straight to the transport while the connection has not paused writing (one send per
    token: no tasks, no timer); once paused it is guarded by the write timeout again."""
    from prefixkv.server import sse

    class Connection:
        paused = False

        def write_would_wait(self) -> bool:
            return self.paused

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def scenario() -> None:
        connection = Connection()
        response = sse.EventStreamResponse(_no_events(), on_close=lambda: None, write_timeout=0.05)
        guarded = response._guarded(send, connection)
        futures = 0
        ensure_future = asyncio.ensure_future

        def counted(*args, **kwargs):
            nonlocal futures
            futures += 1
            return ensure_future(*args, **kwargs)

        monkeypatch.setattr(sse.asyncio, "ensure_future", counted)
        await guarded({"type": "http.response.body", "body": b"a"})
        assert futures == 0 and len(sent) == 1
        connection.paused = True
        await guarded({"type": "http.response.body", "body": b"b"})  # the guard's own send does not block
        assert futures == 1 and len(sent) == 2

    asyncio.run(scenario())


async def _no_events():
    return
    yield
