"""One engine replica: the single-process server app, driven in process by the ingress's forwarded requests.

Why the whole app rather than new handlers: authentication, validation, OpenAI error bodies and limits stay the
ones `prefixkv serve` has, in one place. The app is called in process (in_process.py: no socket, and a stream
passed on chunk by chunk as the app sends it); its lifespan (the engine thread) is entered on the first
request, because Ray builds the replica synchronously.
`record_routing_stats` is Ray Serve's hook for per-replica routing data: it returns the app's /load gauges, which
Ray's controller polls and hands to every request router (RunningReplica.routing_stats). For the precise policy
the replica also publishes its KV events over ZMQ (the engine's own publisher, on free ports) and its stats carry
the addresses, so each request router subscribes itself: events reach every router, exactly once each, with
replay on a gap, rather than going through Ray's stats (which keep only the latest value).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from prefixkv.config import EngineConfig
from prefixkv.router.request import RouteRequest
from prefixkv.serve_ray.in_process import call_app, call_app_whole
from prefixkv.serve_ray.messages import ForwardedRequest, ForwardedResponse
from prefixkv.server.options import ServingOptions
from prefixkv.server.router_hints import HELD_ELSEWHERE

logger = logging.getLogger("ray.serve")  # Serve's logger: lines land in the replica's Serve log

REPLICA_HEADER = "x-prefixkv-replica"  # which replica answered: for logs, debugging and tests
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "host"}
_NOT_FORWARDED = _HOP_BY_HOP | {HELD_ELSEWHERE}  # the held-elsewhere header comes from the router, not the client


class EngineReplica:
    """The deployment class (deployment.py wraps it with serve.deployment)."""

    def __init__(self, config: EngineConfig, app_options: ServingOptions, publish_kv_events: bool = False) -> None:
        from prefixkv.llm import build_engine
        from prefixkv.server.app import build_app
        from prefixkv.server.engine_thread import on_short_lived_thread

        self._kv_events: dict[str, str] = {}
        if publish_kv_events:
            pub, replay = _free_port(), _free_port()
            config = replace(config, kv_events_endpoint=f"tcp://*:{pub}", kv_events_replay_endpoint=f"tcp://*:{replay}")
            host = _node_ip()
            self._kv_events = {
                "kv_events_endpoint": f"tcp://{host}:{pub}",
                "kv_events_replay_endpoint": f"tcp://{host}:{replay}",
            }
        if (niceness := os.nice(0)) > 0:
            logger.warning(
                "replica runs at niceness %d: any other process on this node takes the CPU first (start Ray with "
                "RAY_worker_niceness=0; a local Ray that prefixkv starts does)",
                niceness,
            )
        # loaded on a thread that ends, so the engine thread is the only one left running kernels (engine_thread.py)
        self._app = build_app(on_short_lived_thread(lambda: build_engine(config)), app_options)
        self._lifespan = contextlib.AsyncExitStack()
        self._started = asyncio.Lock()
        self._running = False
        self.replica_id = _replica_id()

    async def _start(self) -> None:
        async with self._started:
            if not self._running:
                await self._lifespan.enter_async_context(self._app.router.lifespan_context(self._app))
                self._running = True

    def _headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [*((k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP), (REPLICA_HEADER, self.replica_id)]

    def _request_headers(self, request: ForwardedRequest) -> list[tuple[str, str]]:
        """The app's request headers; with what the router recorded while routing it here (Router.route ran in the
        caller's process before Ray sent the arguments) as the held-elsewhere header, never a client's."""
        headers = [(k, v) for k, v in request.headers if k.lower() not in _NOT_FORWARDED]
        if request.route.held_elsewhere_tokens > 0:
            headers.append((HELD_ELSEWHERE, str(request.route.held_elsewhere_tokens)))
        return headers

    async def handle(self, request: ForwardedRequest) -> ForwardedResponse:
        """A whole (non-streaming) response."""
        await self._start()
        status, headers, body = await call_app_whole(
            self._app, request.method, request.path, self._request_headers(request), request.body
        )
        return ForwardedResponse(status, self._headers(headers), body)

    async def handle_stream(self, request: ForwardedRequest) -> AsyncIterator[bytes | ForwardedResponse]:
        """A streaming response: first its status and headers (empty body), then its body chunks as the app sends
        them. Closed early (the client went away), the app sees the disconnect and the engine aborts the request."""
        await self._start()
        answer = call_app(self._app, request.method, request.path, self._request_headers(request), request.body)
        try:
            async for part in answer:
                if isinstance(part, bytes):
                    yield part
                else:
                    yield ForwardedResponse(part[0], self._headers(part[1]), b"")
        finally:
            await answer.aclose()

    async def identify(self, route: RouteRequest) -> str:
        """This replica's id. `route` is for the request router, which records the live replicas on it: how the
        ingress learns whom to fan a listing out to before any request has told it."""
        return self.replica_id

    async def holds_cache_entry(self, route: RouteRequest, entry_id: str) -> tuple[str, bool]:
        """Whether this replica's store holds the live cache entry `entry_id`, whoever owns it (the ingress only
        routes on the answer: the request it then forwards is answered with the caller's own rights), and which
        replica answered (a call targeting a replica that died is answered by another)."""
        server = self._app.state.server
        return self.replica_id, server.caches.get(entry_id, None, admin=True) is not None

    async def record_routing_stats(self) -> dict[str, Any]:
        await self._start()
        from starlette.requests import Request

        from prefixkv.server.admin import load

        # The /load handler itself, not an HTTP call: the endpoint may require a key the replica does not hold.
        stats = await load(Request({"type": "http", "app": self._app, "headers": []}))
        return {**stats, **self._kv_events}  # addresses a router on another node can connect to

    async def check_health(self) -> None:
        """Ray's health probe: the engine thread must answer."""
        await self._start()
        status, _, _ = await call_app_whole(self._app, "GET", "/health", [], b"")
        if status != 200:
            raise RuntimeError(f"replica unhealthy: /health answered {status}")


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # built outside a Serve replica (a unit test): no Ray id to report
        return "local"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return "127.0.0.1"
