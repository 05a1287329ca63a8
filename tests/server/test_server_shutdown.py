"""SIGTERM on a real `python -m prefixkv.server` process with a stream running (issue 9, item 8).

Long --shutdown-timeout: the stream finishes normally. Short one: it ends with an OpenAI error event and
`data: [DONE]`, never a bare reset. Either way the process exits 0 soon after. Small KV pool; raw httpx
streaming, so the test sees the exact events (the official client turns an error event into an APIError).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.server.live_server import server_process

HANG_GUARD = 120.0


class _RawStream(threading.Thread):
    """Reads the SSE lines of one streaming completion; records every `data:` payload and how it ended."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
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
            with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=HANG_GUARD) as r:
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


@pytest.mark.parametrize("shutdown_timeout, max_tokens", [(60.0, 24), (1.0, 3000)], ids=["drained", "cut"])
def test_sigterm_with_a_running_stream(tmp_path, shutdown_timeout, max_tokens):
    flags = ("--kv-cache-tokens", "4096", "--shutdown-timeout", str(shutdown_timeout), "--log-level", "info")
    with server_process(tmp_path, *flags, hang_guard=180) as (proc, base, _):
        stream = _RawStream(base, max_tokens)
        stream.start()
        assert stream.first_token.wait(HANG_GUARD) and stream.events, stream.transport_error
        rc, took = _sigterm_and_wait(proc, limit=shutdown_timeout + 15)
        stream.join(HANG_GUARD)
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
