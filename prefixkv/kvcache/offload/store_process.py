"""A Redis server as a child process, for the shared KV tier's tests, demo and benchmarks (an operator runs their own).

`redis-server` is Debian's (scripts/setup.sh installs it). It runs as a cache, not a database: no snapshots, no
append-only file, `maxmemory` with least-recently-used eviction over every key (the store drops old chunks by
itself, as a tier must), on 127.0.0.1 only. `python -m prefixkv.kvcache.offload.store_process --port 6390` runs one
in the foreground and prints its URL.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MAXMEMORY = "2gb"


def redis_server_binary() -> str | None:
    """redis-server's path, or None when it is not installed."""
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if Path(p).exists()), None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1:port (a free one by default), started by start(), stopped by stop().

    policy: what the store does when full: "allkeys-lru" (evict, the tier's mode) or "noeviction" (refuse writes,
    for the tests of a full store)."""

    def __init__(self, port: int | None = None, maxmemory: str = DEFAULT_MAXMEMORY, policy: str = "allkeys-lru"):
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (scripts/setup.sh installs Debian's)")
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.process: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="prefixkv-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server (empty) and wait until it answers; raises RuntimeError when it does not."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy, "--dir", self._dir]
        args += ["--daemonize", "no", "--loglevel", "warning"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err[-500:]}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def restart(self) -> None:
        """Stop and start again on the same port: the store comes back empty (no snapshot)."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=6390)
    parser.add_argument("--maxmemory", default=DEFAULT_MAXMEMORY)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a plain kill stops the store too
    with RedisServer(args.port, args.maxmemory) as server:
        print(server.url, flush=True)
        try:
            assert server.process is not None
            server.process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
