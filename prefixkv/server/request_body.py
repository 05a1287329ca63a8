"""Read every request body up front, under a size limit and a deadline, before any handler sees it.

Why up front: FastAPI reads the whole body before validating it anyway, so reading it here costs no more
memory, and it is the only place where an over-size or stalled body can still get a proper answer (413 / 408
in the called API's error format) instead of a parse error from inside the handler.

A body whose Content-Length is already too large is refused without reading it. The 413 is then sent in full,
and the connection is held open for a bounded time (`_LINGER_SECONDS`, `_LINGER_BYTES`) while the rest of the
upload is read and thrown away: closing a socket with unread data makes the kernel send a reset, which can
destroy the 413 before a client that is still uploading reads it (nginx's "lingering close").
"""

from __future__ import annotations

import asyncio
import json
import logging

from prefixkv.server.errors import APIError

logger = logging.getLogger(__name__)

_LINGER_SECONDS = 2.0
_LINGER_BYTES = 64 << 20


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class BoundedRequestBody:
    """ASGI middleware: 413 above max_bytes, 408 when the body is not in after timeout seconds."""

    def __init__(self, app, *, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
        if length is None and not chunked:  # no body (GET, or a POST without one)
            return await self.app(scope, receive, send)
        if length is not None and int(length) > self.max_bytes:  # h11 has checked it is a number
            return await self._refuse(scope, receive, send, self._too_large(), drain=True)
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            error = APIError(
                f"The request body was not received within {self.timeout:g} seconds", status=408, code="request_timeout"
            )
            return await self._refuse(scope, receive, send, error, drain=False)
        except _TooLarge:
            return await self._refuse(scope, receive, send, self._too_large(), drain=True)
        except _Disconnected:
            return None
        return await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> APIError:
        return APIError(
            f"The request body is larger than the limit of {self.max_bytes} bytes (--max-request-body-bytes)",
            status=413,
            code="request_too_large",
        )

    async def _read(self, receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope, receive, send, error: APIError, *, drain: bool) -> None:
        """Send the error with `Connection: close`; with drain, read and drop the upload before closing."""
        payload = json.dumps(error.body_for(scope.get("path", ""))).encode()  # in the shape of the API called
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        expects_continue = (_header(scope, b"expect") or b"").lower() == b"100-continue"
        if drain and not expects_continue:  # such a client waits for our answer instead of uploading
            await send({"type": "http.response.body", "body": payload, "more_body": True})
            await _discard_upload(receive)
            payload = b""
        await send({"type": "http.response.body", "body": payload, "more_body": False})


async def _discard_upload(receive) -> None:
    discarded = 0
    try:
        async with asyncio.timeout(_LINGER_SECONDS):
            while discarded < _LINGER_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                discarded += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return


def _replay(body: bytes, receive):
    """A receive() that hands the app the body read above, then passes through (to see the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        if pending:
            return pending.pop()
        return await receive()

    return replayed
