"""A `prefixkv serve` process for the benchmarks that measure through HTTP (restart, routing): started on a free
port, waited for until it answers, always stopped.

The process gets a session of its own, so stopping it stops what it started (a local Ray and its workers for
`serve --replicas`). SIGTERM first: a drained shutdown finishes in-flight work and flushes the KV tier's writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator


def wait_for_replicas(base: str, count: int, timeout_s: float = 600.0) -> None:
    """Until the ingress at `base` routes over `count` replicas: `serve --replicas N` answers once its first replica
    is up, and a benchmark that started then would measure fewer replicas than it names. The ingress's request
    routers list the replicas they see (GET /ingress/stats); a request makes the first router."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(base + "/v1/models", timeout=30):
            pass
        with urllib.request.urlopen(base + "/ingress/stats", timeout=30) as response:
            routers = json.load(response).get("routers", [])
        seen = max((len(view) for view in routers), default=0)
        if seen >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ingress routed over {seen} replicas within {timeout_s:.0f} s, not {count}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(
    serve_args: list[str], ready_path: str = "/health", startup_timeout: float = 600.0, log_path: str | None = None
) -> Iterator[str]:
    """`python -m prefixkv serve --port P *serve_args`; yields its base URL once GET ready_path answers 200.
    RuntimeError (naming the log) when it exits or is not ready in time."""
    port = free_port()
    argv = [sys.executable, "-m", "prefixkv", "serve", "--port", str(port), *serve_args]
    log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    where = f" (log: {log_path})" if log_path else ""
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready{where}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + ready_path, timeout=5) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {startup_timeout:.0f} s{where}")
            time.sleep(0.3)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if log is not None:
            log.close()
