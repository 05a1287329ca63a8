"""uvicorn's h11 protocol plus what h11 leaves out: a header deadline, a connection cap, a hard close.

- Header deadline: h11 waits for the end of the headers forever, so a client that sends half a request line
  and stalls (slowloris) holds a socket and a file descriptor until the process runs out of them. The deadline
  runs from the connection (or from the first byte of the next request on a keep-alive connection) until the
  request reaches the app; then the body deadline of request_body.py takes over.
- Connection cap: beyond `max_connections` open connections a new one gets a canned 503 and is closed before
  anything is read, so a flood cannot take every descriptor.
- Hard close: the app may need to drop a connection whose client stopped reading (sse.py). uvicorn only
  closes transports gracefully, which waits for the unsent buffer to drain, i.e. forever for such a client.
  The app finds `abort_connection()` under `scope["extensions"]["prefixkv.connection"]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixkv.server.errors import APIError
from prefixkv.server.limits import ServerLimits

logger = logging.getLogger(__name__)

EXTENSION = "prefixkv.connection"


def _canned_503() -> bytes:
    body = json.dumps(
        APIError("Too many open connections; retry later", status=503, code="too_many_connections").body()
    ).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """One instance per connection (asyncio's protocol model). `limits` is bound with functools.partial."""

    def __init__(
        self, config: Any, server_state: Any, app_state: dict, _loop: Any = None, *, limits: ServerLimits
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.header_deadline: asyncio.TimerHandle | None = None
        self.in_request = False  # the current request reached the app and its response is not complete
        inner_app = self.app

        async def app_with_connection(scope, receive, send) -> None:
            self._stop_header_deadline()
            self.in_request = True
            scope.setdefault("extensions", {})[EXTENSION] = self
            await inner_app(scope, receive, send)

        self.app = app_with_connection

    # -- connection cap and header deadline ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("refused a connection: %d are open (--max-connections)", len(self.connections) - 1)
            transport.write(_canned_503())
            transport.close()
            return
        self._start_header_deadline()

    def data_received(self, data: bytes) -> None:
        if not self.in_request and self.header_deadline is None:  # the first byte of a keep-alive request
            self._start_header_deadline()
        super().data_received(data)

    def on_response_complete(self) -> None:
        self.in_request = False
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_deadline()
        super().connection_lost(exc)

    def _start_header_deadline(self) -> None:
        self._stop_header_deadline()
        self.header_deadline = self.loop.call_later(self.limits.header_timeout, self._header_deadline_passed)

    def _stop_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_deadline_passed(self) -> None:
        self.header_deadline = None
        if not self.transport.is_closing():
            logger.info(
                "closed a connection whose request headers took over %gs (--header-timeout)", self.limits.header_timeout
            )
            self.transport.abort()

    # -- for the app ----------------------------------------------------------------------------------------
    def write_would_wait(self) -> bool:
        """Whether the app's next send would wait for the client to read: uvicorn's send awaits only while the
        transport has paused writing (its buffer over the high-water mark); otherwise it writes and returns."""
        return self.flow.write_paused

    def abort_connection(self) -> None:
        """Drop the connection now, discarding whatever is still buffered for the client."""
        # also after close(): that one waits to flush the buffer to a client that will not read it
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():
            self.transport.abort()
