"""The real `python -m prefixkv.server` process: it serves as a user starts it, and SIGTERM with a stream running
(issue 9, item 8).

Long --shutdown-timeout: the stream finishes normally. Short one: it ends with an OpenAI error event and
`data: [DONE]`, never a bare reset. Either way the process exits 0 soon after. Small KV pool; raw httpx
streaming, so the test sees the exact events (the official client turns an error event into an APIError).
Each SIGTERM ends its process, so each case starts one; the drained case's process first answers as the served
command does (its key enforced, the in-process LLM's greedy text), so no other test starts one for that.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from prefixkv.sampling_params import SamplingParams
from tests.server.live_server import server_process

HANG_GUARD = 120.0
KEY = "test-key"
FLAGS = ("--kv-cache-tokens", "4096", "--log-level", "info")


class _RawStream(threading.Thread):
    """Reads the SSE lines of one streaming completion; records every `data:` payload and how it ended."""

    def __init__(self, base: str, max_tokens: int, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens, self.headers = base, max_tokens, headers
        self.events: list[str] = []
        self.transport_error: Exception | None = None
        self.first_token = threading.Event()

    def run(self) -> None:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            url = self.base + "/v1/completions"
            with httpx.stream("POST", url, json=body, headers=self.headers, timeout=HANG_GUARD) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first_token.set()
        except httpx.HTTPError as exc:  # a reset or an incomplete chunked body: what must not happen
            self.transport_error = exc
        finally:
            self.first_token.set()

    def payloads(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def _sigterm_and_wait(proc: subprocess.Popen, limit: float) -> tuple[int, float]:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the server did not exit within {limit}s of SIGTERM")
    return rc, time.monotonic() - t0


def _sigterm_during_a_stream(
    proc: subprocess.Popen, base: str, shutdown_timeout: float, max_tokens: int, headers: dict | None = None
) -> tuple[_RawStream, int, float]:
    """Start a stream, SIGTERM the server once its first token is in, and wait for both to end."""
    stream = _RawStream(base, max_tokens, headers)
    stream.start()
    assert stream.first_token.wait(HANG_GUARD) and stream.events, stream.transport_error
    rc, took = _sigterm_and_wait(proc, limit=shutdown_timeout + 15)
    stream.join(HANG_GUARD)
    return stream, rc, took


def _assert_stream_ended(tmp_path, stream: _RawStream, rc: int, took: float, shutdown_timeout: float) -> None:
    server_log = (tmp_path / "server.log").read_text()
    assert stream.transport_error is None, f"{stream.transport_error!r}\n{server_log[-3000:]}"
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    payloads = stream.payloads()
    if shutdown_timeout > 10:  # drained: every token, a normal finish
        assert "error" not in payloads[-1]
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(p["choices"][0]["text"] for p in payloads)
        assert text  # and the process waited for it
    else:  # cut: an OpenAI error event right before [DONE]
        err = payloads[-1]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "server_shutdown", err
        assert all("error" not in p and p["choices"][0]["finish_reason"] is None for p in payloads[:-1])
    assert rc == 0, server_log[-3000:]
    print(
        f"\nshutdown_timeout={shutdown_timeout:g}s: exited {rc} {took:.1f}s after SIGTERM, "
        f"{len(payloads)} events, last: {stream.events[-2][:100]}"
    )


def test_the_server_command_serves_then_drains_on_sigterm(tmp_path, llm_factory):
    """`python -m prefixkv.server` as a user starts it: it comes up, enforces its key and serves the same greedy
    text as the in-process LLM. Then SIGTERM with a stream running, under a long --shutdown-timeout: the stream
    finishes normally and the process exits 0. The deadlines only guard against a hang: start-up takes seconds."""
    flags = (*FLAGS, "--api-key", KEY, "--shutdown-timeout", "60")
    with server_process(tmp_path, *flags) as (proc, base, _):
        assert httpx.get(base + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        prompt = "The capital of France is"
        got = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        want = (
            llm_factory(prefix_cache="off")
            .generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
            .outputs[0]
        )
        assert got.choices[0].text == want.text
        client.close()
        stream, rc, took = _sigterm_during_a_stream(proc, base, 60.0, 24, {"Authorization": f"Bearer {KEY}"})
    _assert_stream_ended(tmp_path, stream, rc, took, 60.0)


def test_sigterm_cuts_a_stream_past_the_shutdown_timeout(tmp_path):
    with server_process(tmp_path, *FLAGS, "--shutdown-timeout", "1.0", hang_guard=180) as (proc, base, _):
        stream, rc, took = _sigterm_during_a_stream(proc, base, 1.0, 3000)
    _assert_stream_ended(tmp_path, stream, rc, took, 1.0)
