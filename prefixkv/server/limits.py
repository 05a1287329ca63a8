"""The server's limits on what one connection or client may cost: sizes, deadlines, counts.

One dataclass so `prefixkv serve`, the tests' in-process server and build_app read the same defaults, and one
argparse group so every limit is an option. Where each limit is enforced:

- request_body.py: max_request_body_bytes, body_timeout (an ASGI middleware, before any handler runs);
- connection.py: header_timeout, max_connections (the HTTP protocol, before the ASGI app exists);
- uvicorn itself: timeout_keep_alive;
- async_engine.py / sse.py: max_stream_queue, stream_write_timeout (a stream whose client stopped reading);
- serving.py: shutdown_timeout (SIGTERM).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

MiB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 8 * MiB  # 413 above; a 8k-token prompt is ~40 KB, a 10 MB body is an attack
    header_timeout: float = 10.0  # seconds from the first byte of a request (or the connection) to its last header
    body_timeout: float = 60.0  # seconds to receive the whole body once headers are in (8 MiB at >= 140 KB/s)
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
    max_connections: int = 1000  # open connections; more are answered 503 and closed at once
    shutdown_timeout: float = 30.0  # on SIGTERM: seconds in-flight requests may take before they are cut
    max_stream_queue: int = 1024  # engine outputs a reader may fall behind by before its request is aborted
    stream_write_timeout: float = 30.0  # seconds one write to a client may block before the stream is aborted

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")


_HELP = {
    "max_request_body_bytes": "larger request bodies get a 413 (Content-Length checked before reading)",
    "header_timeout": "close a connection whose request headers are not complete after this many seconds",
    "body_timeout": "answer 408 and close when a request body is not complete this many seconds after its headers",
    "timeout_keep_alive": "close an idle keep-alive connection after this many seconds",
    "max_connections": "answer 503 and close connections beyond this many open ones",
    "shutdown_timeout": "on SIGTERM, let in-flight requests finish for this many seconds, then cut them "
    "(streams end with an error event and [DONE])",
    "max_stream_queue": "abort a request and drop its connection when its client is this many outputs behind",
    "stream_write_timeout": "abort a stream whose client has not accepted a write for this many seconds",
}


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("connection limits")
    defaults = ServerLimits()
    for f in fields(ServerLimits):
        default = getattr(defaults, f.name)
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{_HELP[f.name]} (default: {default})",
        )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
