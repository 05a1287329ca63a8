"""Run the real app (uvicorn on 127.0.0.1) around a FakeEngine in a background thread."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from prefixkv.server.app import build_app
from tests.server.fake_engine import FakeEngine


@contextmanager
def running_fake_server(engine: FakeEngine | None = None, **app_kwargs):
    engine = engine or FakeEngine()
    app = build_app(engine, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        httpx.get(base + "/health").raise_for_status()
        yield base, engine, app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
