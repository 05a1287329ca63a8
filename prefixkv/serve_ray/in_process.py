"""Calling the server's ASGI app in this process, its response passed on as the app sends it.

Why not httpx's ASGI transport: it collects the whole body before it returns, so a stream through a replica
reached the client in one piece after its last token (time to first token = the whole answer), and a client
that went away could not stop the generation. Here the app runs as a task; what it sends goes through a queue;
the caller gets the status and headers as soon as the app starts its response, then each body chunk. Closing the
caller's iterator early (the client went away) tells the app the client disconnected and cancels it, as a socket
server would, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

Message = MutableMapping[str, Any]
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]
_DONE: Message = {"type": "prefixkv.app_returned"}


async def call_app(
    app: ASGIApp, method: str, path: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncGenerator[tuple[int, list[tuple[str, str]]] | bytes, None]:
    """Yields (status, headers) once, then the body's chunks. An exception the app raises is raised here."""
    url = urlsplit(path)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": url.path,
        "raw_path": url.path.encode(),
        "query_string": url.query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "server": ("replica", 80),
        "client": ("127.0.0.1", 0),
    }
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()  # the caller stopped reading: the client disconnected
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not _DONE:
            if message["type"] == "http.response.start":
                raw = message.get("headers", [])
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
            elif message["type"] == "http.response.body":
                if chunk := message.get("body", b""):
                    yield chunk
                if not message.get("more_body", False):
                    break
        await task  # the app's exception, if it raised one
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def call_app_whole(
    app: ASGIApp, method: str, path: str, headers: list[tuple[str, str]], body: bytes
) -> tuple[int, list[tuple[str, str]], bytes]:
    """The whole response: status, headers, body."""
    status, answer_headers, chunks = 500, [], []  # type: tuple[int, list[tuple[str, str]], list[bytes]]
    async for part in call_app(app, method, path, headers, body):
        if isinstance(part, bytes):
            chunks.append(part)
        else:
            status, answer_headers = part
    return status, answer_headers, b"".join(chunks)
