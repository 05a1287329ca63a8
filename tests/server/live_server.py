"""Run the real app (uvicorn on 127.0.0.1, a free port) around an engine in a background thread.

In-process, so a test can reach the engine behind the server (to inject a fault into its real parts, or to
see what a request handed it). The engine thread starts and stops with the app's lifespan.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from prefixkv.server.app import build_app
from prefixkv.server.options import ServingOptions
from prefixkv.server.serving import make_server


@contextmanager
def running_server(
    engine: Any, *, send_buffer_bytes: int | None = None, write_buffer_bytes: int | None = None, **app_kwargs
) -> Iterator[tuple[str, Any, Any]]:
    """Yield (base_url, engine, app) while uvicorn serves build_app(engine, **app_kwargs); pass
    limits=ServerLimits(...) to change a limit (shutdown at exit waits up to limits.shutdown_timeout).

    send_buffer_bytes: the kernel send buffer of every accepted connection (inherited from the listening
    socket). On loopback it autotunes to ~4 MB, which a client that never reads would take minutes of
    generation to fill; a small one makes the server's writes block after a few KB, as over a real network.

    write_buffer_bytes: the high-water mark of asyncio's own write buffer on every accepted connection (64 KiB by
    default), above which the transport pauses the protocol and uvicorn's send waits for it to drain. A client
    that never reads fills it after the kernel buffers; at ~1 KB of stream per token that takes seconds of
    generation, a small mark a few tokens. Only the amount buffered changes: the same pause, the same waits."""
    app = build_app(engine, ServingOptions(**app_kwargs))
    sock = socket.socket()
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, log_level="warning")  # the uvicorn setup `prefixkv serve` runs, limits included
    if write_buffer_bytes is not None:
        server.config.http = _with_write_buffer(server.config.http, write_buffer_bytes)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        httpx.get(base + "/health").raise_for_status()
        yield base, engine, app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _with_write_buffer(protocol_factory: Any, high: int) -> Any:
    """The server's own protocol factory, each connection's transport given a write buffer high-water mark of
    `high` bytes before the protocol sees it (the protocol, its flow control and its limits are unchanged)."""

    def make(*args: Any, **kwargs: Any) -> Any:
        protocol = protocol_factory(*args, **kwargs)
        connection_made = protocol.connection_made

        def with_limits(transport: Any) -> None:
            transport.set_write_buffer_limits(high=high)
            connection_made(transport)

        protocol.connection_made = with_limits
        return protocol

    return make


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def metric_samples(base: str, headers: dict) -> dict[str, float]:
    """Every sample of /metrics as {"name{labels}": value}."""
    out = {}
    for line in httpx.get(base + "/metrics", headers=headers).text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def cache_summary(base: str, headers: dict) -> dict:
    """GET /cache/summary of a running server."""
    return httpx.get(base + "/cache/summary", headers=headers).json()


def wait_no_pages_held(base: str, headers: dict, timeout: float = 20.0) -> dict:
    """Poll /cache/summary until no request runs, waits or holds a KV page (aborts free pages asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        s = cache_summary(base, headers)
        if s["kv_pages_used"] == 0 and s["engine"]["num_running"] == 0 and s["engine"]["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"pages still held: {s}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(tmp_path: Any, *flags: str, hang_guard: float = 900.0) -> Iterator[tuple[Any, str, Any]]:
    """Run `python -m prefixkv.server --port P *flags` as a user starts it; yield (process, base_url, log path)
    once /health answers. The server's output goes to a file (a full pipe would block it); on exit the process
    is terminated if the test has not ended it. hang_guard only guards against a server that never comes up."""
    import os
    import subprocess
    import sys

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixkv.server", "--port", str(port), *flags],
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + hang_guard
            while True:
                assert proc.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
                try:
                    if httpx.get(base + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the server did not become healthy"
                time.sleep(0.3)
            yield proc, base, log_path
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
