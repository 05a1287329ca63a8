"""The one OpenAI-compatible front door: every HTTP request is forwarded whole to a replica Ray's request router
picked; the replica's app answers it (so the API is exactly the single-process server's).

Faults: a replica that dies before answering (its actor killed, its node lost) costs the client nothing for a
non-streaming request or a stream that has not started: the ingress retries on another replica (Ray's router has
dropped the dead one). A stream already under way cannot be replayed, so it ends with an OpenAI error event and
`[DONE]`. When no replica answers after the retries, the client gets a 503 in OpenAI's error format.

What the retries did is visible: every answer carries `x-prefixkv-retries` (how many replicas were lost under
this request before the one named by `x-prefixkv-replica` answered), and `GET /ingress/stats` (any valid key, as
/metrics) returns the ingress's counters: requests forwarded, retries, requests left unanswered, streams cut, and
the attempts lost per replica actor (Ray's actor id, as in `ray list actors` and the "replica lost" warnings).

No `from __future__ import annotations` here: FastAPI must see the handler's real annotation types once Serve
has rebound the class methods.
"""

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from prefixkv.router.request import RouteRequest
from prefixkv.serve_ray.messages import ForwardedRequest, ForwardedResponse
from prefixkv.server.auth import OPEN, KeyRing, derive_cache_salt, isolation_mode, request_api_key
from prefixkv.server.errors import APIError
from prefixkv.server.options import ServingOptions
from prefixkv.server.router_hints import HELD_ELSEWHERE

logger = logging.getLogger("ray.serve")  # Serve's logger: lines land in the ingress replica's Serve log

MAX_ATTEMPTS = 3  # one try and two retries on other replicas
RETRIES_HEADER = "x-prefixkv-retries"  # on every answer: replicas lost under the request before one answered
STATS_PATH = "/ingress/stats"  # the ingress's own counters (every other path goes to a replica)
_REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)

app = FastAPI(title="prefixkv (Ray Serve)")


def _error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "service_unavailable", "param": None, "code": status}}


class TenantSalts:
    """The cache salt each replica will give a request, computed in front of them from the same key file and
    isolation mode (prefixkv.server.auth), so a router keys two tenants' equal prompts apart as the caches do."""

    def __init__(self, app_options: ServingOptions) -> None:
        self.keys = KeyRing.build(app_options.api_key, app_options.api_key_file)
        self.mode = isolation_mode(app_options.tenant_isolation, app_options.api_key_file)

    def salt(self, headers: dict[str, str], body: dict) -> str | None:
        client_salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        user = body.get("user") if isinstance(body.get("user"), str) else None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        principal = OPEN if self.keys is None else self.keys.identify(bearer)
        if principal is None:  # the replica answers 401; where it routes does not matter
            return client_salt
        return derive_cache_salt(self.mode, principal, bearer, user, client_salt)


def route_request(
    body: bytes, headers: dict[str, str], tokenizer: Any = None, salts: TenantSalts | None = None
) -> RouteRequest:
    """What the router learns from the request before any replica sees it: its session key (prompt_cache_key or
    the x-session-id header) and, with a tokenizer (cache-aware policies), the prompt's token ids: a completion's
    (first) prompt, or a chat rendered through the chat template, as the replica will render it, with the
    tenant's cache salt. The request is not validated here: a body the replica will refuse just routes without
    tokens."""
    session = headers.get("x-session-id")
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return RouteRequest(token_ids=[], session_key=session)
    if isinstance(parsed.get("prompt_cache_key"), str):
        session = parsed["prompt_cache_key"]
    tokens: list[int] = []
    if tokenizer is not None:
        try:
            tokens = _prompt_tokens(parsed, tokenizer)
        except Exception:  # noqa: BLE001 - malformed input: the replica answers it with a proper 400
            tokens = []
    salt = salts.salt(headers, parsed) if salts is not None else None
    return RouteRequest(token_ids=tokens, cache_salt=salt, session_key=session)


def _prompt_tokens(body: dict, tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # several prompts: route on the first
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        return tokenizer.encode(tokenizer.apply_chat_template(messages))
    return []


def routing_tokenizer(model: str | None) -> Any:
    """The model's tokenizer alone (no weights): what the ingress needs to hash prompts as the replicas do."""
    import os

    from prefixkv.model.loader import default_model_path
    from prefixkv.model.tokenizer import Tokenizer

    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isfile(path):
        return Tokenizer.from_gguf(path, "router")
    return Tokenizer.from_hf_dir(path, "router")


class IngressStats:
    """What the ingress's retries did, since it started (one ingress replica's counts)."""

    def __init__(self) -> None:
        self.requests = 0  # forwarded to the replicas (the stats endpoint itself is not counted)
        self.retries = 0  # attempts re-sent to another replica after one was lost under them
        self.unanswered = 0  # requests answered 503: every attempt's replica was lost
        self.streams_cut = 0  # streams whose replica was lost after they had started (not replayable)
        self.lost_attempts: Counter[str] = Counter()  # replica actor id -> attempts lost with it

    def lost(self, exc: RayActorError, attempt: int, what: str) -> None:
        logger.warning("replica lost %s (attempt %d of %d): %s", what, attempt + 1, MAX_ATTEMPTS, exc)
        self.lost_attempts[getattr(exc, "actor_id", None) or "unknown"] += 1
        if attempt + 1 < MAX_ATTEMPTS:
            self.retries += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "retries": self.retries,
            "unanswered": self.unanswered,
            "streams_cut": self.streams_cut,
            "lost_attempts_by_replica_actor": dict(self.lost_attempts),
        }


def _answer_headers(answer: ForwardedResponse, retries: int) -> dict[str, str]:
    return {**dict(answer.headers), RETRIES_HEADER: str(retries)}


def _wants_stream(body: bytes) -> bool:
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


# The ingress only forwards: it holds many requests at once (Ray's default of 5 would queue clients in front of
# idle replicas); the replicas' own max_ongoing_requests is the backpressure that matters.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        replicas: DeploymentHandle,
        model: str | None = None,
        tokenize: bool = False,
        app_options: ServingOptions | None = None,
    ) -> None:
        """tokenize: give the router each prompt's token ids and cache salt (for the cache-aware policies);
        app_options: the replicas' app options (their keys and tenant isolation decide the salts)."""
        self._replicas = replicas
        self._tokenizer = routing_tokenizer(model) if tokenize else None
        options = app_options or ServingOptions()
        self._salts = TenantSalts(options) if tokenize else None
        self._keys = KeyRing.build(options.api_key, options.api_key_file)
        self.stats = IngressStats()

    # Before the catch-all route below: FastAPI matches routes in the order they were declared.
    @app.get(STATS_PATH)
    async def ingress_stats(self, raw: Request) -> Any:
        if self._keys is not None and self._keys.identify(request_api_key(raw)) is None:
            message = "Invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            return APIError(message, status=401, code="invalid_api_key").response()
        return self.stats.as_dict()

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def forward(self, path: str, raw: Request) -> Any:
        body = await raw.body()
        target = raw.url.path + (f"?{raw.url.query}" if raw.url.query else "")
        route = route_request(body, dict(raw.headers), self._tokenizer, self._salts)
        # what another replica holds is the router's to say (replica.py sets it), never a client's
        headers = [(k, v) for k, v in raw.headers.items() if k.lower() != HELD_ELSEWHERE]
        request = ForwardedRequest(raw.method, target, headers, body, route)
        self.stats.requests += 1
        if _wants_stream(body):
            return await self._stream(request)
        for attempt in range(MAX_ATTEMPTS):
            try:
                answer: ForwardedResponse = await self._replicas.handle.remote(request)
            except _REPLICA_LOST as exc:
                self.stats.lost(exc, attempt, "before answering")
                continue
            return Response(answer.body, status_code=answer.status, headers=_answer_headers(answer, attempt))
        return self._unanswered()

    async def _stream(self, request: ForwardedRequest) -> Response:
        for attempt in range(MAX_ATTEMPTS):
            chunks: Any = self._replicas.options(stream=True).handle_stream.remote(request)
            try:
                head: ForwardedResponse = await chunks.__anext__()
            except _REPLICA_LOST as exc:
                self.stats.lost(exc, attempt, "before streaming")
                continue
            headers = _answer_headers(head, attempt)
            return StreamingResponse(self._rest(chunks), status_code=head.status, headers=headers)
        return self._unanswered()

    def _unanswered(self) -> Response:
        self.stats.unanswered += 1
        return JSONResponse(_error(503, "no engine replica could answer the request"), status_code=503)

    async def _rest(self, chunks: Any) -> AsyncIterator[bytes]:
        """The body chunks after the head; a replica lost mid-stream ends it with an error event and [DONE]."""
        try:
            async for chunk in chunks:
                yield chunk
        except _REPLICA_LOST as exc:
            self.stats.streams_cut += 1
            self.stats.lost_attempts[getattr(exc, "actor_id", None) or "unknown"] += 1
            logger.warning("replica lost mid-stream: %s", exc)
            yield f"data: {json.dumps(_error(503, 'the engine replica was lost mid-stream'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
