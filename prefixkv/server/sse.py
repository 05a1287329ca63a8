"""Server-sent events framing and the non-streaming twin of Starlette's disconnect detection.

Starlette cancels a streaming body when the client goes away (the generator's `finally` then aborts the
engine request). A plain JSON handler gets no such signal, so until_disconnected() races the work against
the ASGI `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixkv.server.connection import EXTENSION
from prefixkv.server.errors import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict, event: str | None = None) -> str:
    """One event: its data, and its name where the API names events (Anthropic's do)."""
    data = f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
    return data if event is None else f"event: {event}\n{data}"


def openai_error_event(err: APIError) -> str:
    return sse(err.body())


async def guarded_events(
    events: AsyncIterator[str],
    group,
    error_event: Callable[[APIError], str] = openai_error_event,
    done: str | None = DONE,
) -> AsyncIterator[str]:
    """Once headers are sent an error can only travel as an event (error_event); the stream always ends with
    `done` (OpenAI's [DONE]; None: nothing) and always releases the engine requests of its group."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        err = exc if isinstance(exc, APIError) else APIError(str(exc), status=500)
        yield error_event(err)
    finally:
        group.close()
    if done is not None:
        yield done


class SlowClient(Exception):
    """A write to the client did not complete in time, or its request group was stopped while it waited."""


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs on_close however it ends, even if the body never started (client gone
    before the first byte), so the engine requests behind it are always aborted or already finished.

    A client that stops reading fills the socket buffers and then blocks our writes. A write that blocks for
    more than write_timeout seconds, or while the group is stopped (its reader fell too far behind, see
    RequestGroup), ends the stream: the engine requests are aborted and the connection is dropped at once,
    since a graceful close would wait for that client to read what is still buffered.
    """

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        *,
        group=None,
        write_timeout: float | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close
        self._stopped: asyncio.Event | None = getattr(group, "stopped", None)
        self._write_timeout = write_timeout

    async def __call__(self, scope, receive, send) -> None:
        connection = scope.get("extensions", {}).get(EXTENSION)
        try:
            await super().__call__(scope, receive, self._guarded(send, connection))
        except SlowClient as exc:
            logger.warning("dropped a stream: %s", exc)
            self._on_close()
            if connection is not None:
                connection.abort_connection()
                await asyncio.sleep(0)  # let the transport report the loss, so uvicorn sees a disconnect
        finally:
            self._on_close()

    def _guarded(self, send, connection=None):
        """send, bounded by the write timeout and the group's stop. A send that cannot wait (the connection has
        not paused writing, the usual case: one per token) is awaited directly: it returns without suspending,
        so the guard would only add two tasks, a timer and three event-loop turns to every token."""
        if self._write_timeout is None and self._stopped is None:
            return send
        would_wait = getattr(connection, "write_would_wait", None)

        async def guarded_send(message) -> None:
            if would_wait is not None and not would_wait():
                return await send(message)
            sending = asyncio.ensure_future(send(message))
            waiters = {sending}
            stopped = None
            if self._stopped is not None:
                stopped = asyncio.ensure_future(self._stopped.wait())
                waiters.add(stopped)
            try:
                done, _ = await asyncio.wait(waiters, timeout=self._write_timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if stopped is not None:
                    stopped.cancel()
            if sending in done:
                return sending.result()
            sending.cancel()
            if stopped is not None and stopped in done:
                raise SlowClient("the request was stopped while the client was not reading")
            raise SlowClient(f"the client accepted no data for {self._write_timeout:g}s (--stream-write-timeout)")

        return guarded_send


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (shutdown): stop the work too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientDisconnected()


async def answer(
    raw: Request,
    group,
    events: AsyncIterator[str] | None,
    build: Callable[[list], dict] | None = None,
    error_event: Callable[[APIError], str] = openai_error_event,
    done: str | None = DONE,
):
    """Stream `events` as SSE (ended as guarded_events says), or (events None) wait for every final output and
    return build(finals) as JSON. Either way the engine requests of `group` end with the HTTP request (499 when
    the client left first)."""
    if events is not None:
        write_timeout = raw.app.state.limits.stream_write_timeout
        return EventStreamResponse(
            guarded_events(events, group, error_event, done),
            on_close=group.close,
            group=group,
            write_timeout=write_timeout,
        )
    try:
        finals = await until_disconnected(raw, group.collect())
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    finally:
        group.close()
    assert build is not None, "a plain (non-streamed) answer needs build"
    return build(finals)
