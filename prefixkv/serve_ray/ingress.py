"""The one OpenAI-compatible front door: every HTTP request is forwarded whole to a replica Ray's request router
picked; the replica's app answers it (so the API is exactly the single-process server's).

Faults: a replica that dies before answering (its actor killed, its node lost) costs the client nothing for a
non-streaming request or a stream that has not started: the ingress retries on another replica (Ray's router has
dropped the dead one). A stream already under way cannot be replayed, so it ends with an OpenAI error event and
`[DONE]`. When no replica answers after the retries, the client gets a 503 in OpenAI's error format.

Cache entries (/v1/caches, Gemini's cachedContents) live in the store of the replica that created them, so the
ingress sends every request naming one (its own routes, `cached_content` / `cachedContent`) to that replica and
answers a listing from all replicas merged, as one server would (cache_entries.py: the pins and the merge). A
replica that died took its entries with it: a request naming one routes like any other, and the replica it lands
on answers the API's own "not found". The calls one request makes to several replicas (a listing's pages, the
search for an entry's holder) go one at a time, never gathered: Ray Serve gives each call the internal id of the
request being answered, and a request router hands its choice to the pending call of that id, so of two calls in
flight at once one would never be routed (Ray asks the router again and again).

What the retries did is visible: every answer carries `x-prefixkv-retries` (how many replicas were lost under
this request before the one named by `x-prefixkv-replica` answered), and `GET /ingress/stats` (any valid key, as
/metrics) returns the ingress's counters: requests forwarded, retries, requests left unanswered, streams cut, and
the attempts lost per replica actor (Ray's actor id, as in `ray list actors` and the "replica lost" warnings),
and under `routers` what each request router of the ingress (one per handle) would route on now, per replica: its
polled gauges, floored by that router's own count of the requests it sent there and not yet answered.

No `from __future__ import annotations` here: FastAPI must see the handler's real annotation types once Serve
has rebound the class methods.
"""

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from prefixkv.router.request import RouteRequest
from prefixkv.serve_ray import router_view
from prefixkv.serve_ray.cache_entries import (
    INVALID_PAGE_TOKEN,
    SHAPES,
    CacheCall,
    EntryPins,
    EntryPrefix,
    ReplicaPage,
    cache_call,
    created_entry_id,
    entry_prefix,
    gather_pages,
    list_query,
    listing_body,
    merge_pages,
    replica_page,
)
from prefixkv.serve_ray.messages import ForwardedRequest, ForwardedResponse
from prefixkv.serve_ray.replica import REPLICA_HEADER
from prefixkv.server.auth import OPEN, KeyRing, api_key_of, derive_cache_salt, isolation_mode, request_api_key
from prefixkv.server.cache_store import PAGE_TOKENS_HEADER
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
        key = api_key_of(headers)
        principal = OPEN if self.keys is None else self.keys.identify(key)
        if principal is None:  # the replica answers 401; where it routes does not matter
            return client_salt
        return derive_cache_salt(self.mode, principal, key, user, client_salt)


def route_request(
    body: bytes,
    headers: dict[str, str],
    tokenizer: Any = None,
    salts: TenantSalts | None = None,
    prefix: EntryPrefix | None = None,
) -> RouteRequest:
    """What the router learns from the request before any replica sees it: its session key (prompt_cache_key or
    the x-session-id header) and, with a tokenizer (cache-aware policies), the prompt's token ids: a completion's
    (first) prompt, or a chat rendered through the chat template, as the replica will render it (after `prefix`,
    the cache entry the request names, when the ingress knows it), with the tenant's cache salt. The request is
    not validated here: a body the replica will refuse just routes without tokens."""
    return _route(_json_body(body), headers, tokenizer, salts, prefix)


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:  # UnicodeDecodeError too
        return None


def _route(
    parsed: Any, headers: dict[str, str], tokenizer: Any, salts: TenantSalts | None, prefix: EntryPrefix | None
) -> RouteRequest:
    session = headers.get("x-session-id")
    if not isinstance(parsed, dict):
        return RouteRequest(token_ids=[], session_key=session)
    if isinstance(parsed.get("prompt_cache_key"), str):
        session = parsed["prompt_cache_key"]
    tokens: list[int] = []
    if tokenizer is not None:
        try:
            tokens = _prompt_tokens(parsed, tokenizer, prefix)
        except Exception:  # noqa: BLE001 - malformed input: the replica answers it with a proper 400
            tokens = []
    salt = salts.salt(headers, parsed) if salts is not None else None
    return RouteRequest(token_ids=tokens, cache_salt=salt, session_key=session)


def _prompt_tokens(body: dict, tokenizer: Any, prefix: EntryPrefix | None = None) -> list[int]:
    """A prompt entry's tokens come before the prompt's own (each tokenized alone, as the replica does); a messages
    entry's messages before the chat's, rendered together."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # several prompts: route on the first
    head = list(prefix.token_ids) if prefix is not None and prefix.kind == "prompt" else []
    if isinstance(prompt, str):
        return head + tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return head + prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        if prefix is not None and prefix.kind == "messages":
            messages = [*prefix.messages, *messages]
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

    def gone(self, exc: RayActorError, what: str) -> None:
        """A replica lost under a call that is not retried: one of several to every replica (its cache entries went
        with it)."""
        logger.warning("replica lost %s: %s", what, exc)
        self.lost_attempts[getattr(exc, "actor_id", None) or "unknown"] += 1

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


def _wants_stream(parsed: Any) -> bool:
    return isinstance(parsed, dict) and parsed.get("stream") is True


def _lower(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers}


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
        # one streaming handle for the ingress's life: a handle per stream would mean a request router per stream,
        # each with an empty KV-event index and no count of the streams before it
        self._streaming = replicas.options(stream=True)
        self._tokenizer = routing_tokenizer(model) if tokenize else None
        options = app_options or ServingOptions()
        self._salts = TenantSalts(options) if tokenize else None
        self._keys = KeyRing.build(options.api_key, options.api_key_file)
        self.stats = IngressStats()
        self.pins = EntryPins()  # cache entry id -> the replica holding it
        self._live: tuple[str, ...] = ()  # the live replicas, as the request router last reported them

    # Before the catch-all route below: FastAPI matches routes in the order they were declared.
    @app.get(STATS_PATH)
    async def ingress_stats(self, raw: Request) -> Any:
        if self._keys is not None and self._keys.identify(request_api_key(raw)) is None:
            message = "Invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            return APIError(message, status=401, code="invalid_api_key").response()
        return {**self.stats.as_dict(), "routers": router_view.routers_view()}

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def forward(self, path: str, raw: Request) -> Any:
        body = await raw.body()
        target = raw.url.path + (f"?{raw.url.query}" if raw.url.query else "")
        parsed = _json_body(body)
        call = cache_call(raw.method, raw.url.path, parsed)
        # what another replica holds is the router's to say (replica.py sets it), never a client's
        headers = [(k, v) for k, v in raw.headers.items() if k.lower() != HELD_ELSEWHERE]
        self.stats.requests += 1
        if call is not None and call.kind == "list":
            return await self._list(call, raw, headers)
        entry_id = call.entry_id if call is not None else None
        holder = await self._holder(entry_id) if entry_id is not None else None
        prefix = self.pins.prefix(entry_id) if entry_id is not None and holder is not None else None
        route = _route(parsed, dict(raw.headers), self._tokenizer, self._salts, prefix)
        route.target_replica = holder  # the entry's holder, whatever the session pin or the policy would choose
        request = ForwardedRequest(raw.method, target, headers, body, route)
        if _wants_stream(parsed):
            return await self._stream(request)
        answer, attempt = await self._answer(request)
        if answer is None:
            return self._unanswered()
        if call is not None:
            self._learn(call, request, parsed, answer)
        return Response(answer.body, status_code=answer.status, headers=_answer_headers(answer, attempt))

    async def _answer(self, request: ForwardedRequest) -> tuple[ForwardedResponse | None, int]:
        """A replica's whole answer and the attempt that got it; None when every attempt's replica was lost."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                answer: ForwardedResponse = await self._replicas.handle.remote(request)
            except _REPLICA_LOST as exc:
                self.stats.lost(exc, attempt, "before answering")
                continue
            self._saw(request.route)
            return answer, attempt
        return None, MAX_ATTEMPTS

    def _saw(self, route: RouteRequest) -> None:
        """Keep the live replicas the request router recorded while routing `route` (in this process)."""
        if route.live_replicas:
            self._live = route.live_replicas

    def _learn(self, call: CacheCall, request: ForwardedRequest, parsed: Any, answer: ForwardedResponse) -> None:
        """A created entry is pinned to the replica that made it (with its prefix, for routing its uses); a
        deleted one is unpinned."""
        if answer.status != 200:
            return
        if call.kind == "create":
            entry_id = created_entry_id(call.api, answer.body)
            replica = _lower(answer.headers).get(REPLICA_HEADER)
            if entry_id is not None and replica is not None:
                prefix = entry_prefix(parsed, request.route.token_ids) if call.api == "openai" else None
                self.pins.pin(entry_id, replica, prefix)
        elif call.kind == "entry" and call.entry_id is not None and request.method.upper() == "DELETE":
            self.pins.unpin(call.entry_id)

    async def _live_replicas(self) -> tuple[str, ...]:
        """The live replica ids: as the last routed request saw them, or asked of the request router by a call
        that only identifies a replica (before any request has told the ingress)."""
        for attempt in range(MAX_ATTEMPTS):
            if self._live:
                break
            route = RouteRequest(token_ids=[])
            try:
                await self._replicas.identify.remote(route)
            except _REPLICA_LOST as exc:
                self.stats.lost(exc, attempt, "identifying the replicas")
                continue
            self._saw(route)
        return self._live

    async def _holder(self, entry_id: str) -> str | None:
        """The replica holding cache entry `entry_id`: pinned when this ingress forwarded its create, else asked of
        every live replica (the ingress restarted, or the pin aged out). None when none holds it: the request then
        routes like any other and its replica answers the API's own 'not found'."""
        replica = self.pins.replica(entry_id)
        if replica is not None:
            return replica
        for rid in await self._live_replicas():  # one call at a time (the module's docstring says why)
            try:
                answer = await self._replicas.holds_cache_entry.remote(
                    RouteRequest(token_ids=[], target_replica=rid), entry_id
                )
            except _REPLICA_LOST as exc:
                self.stats.gone(exc, "looking for a cache entry")
                continue
            if answer == (rid, True):  # from that replica itself: a dead target's call is answered by another
                self.pins.pin(entry_id, rid)
                return rid
        return None

    async def _list(self, call: CacheCall, raw: Request, headers: list[tuple[str, str]]) -> Response:
        """A cache listing over every replica, merged into one server's page (cache_entries.py)."""
        query = list_query(call.api, raw.query_params)
        if query is None:  # a size or token one server would refuse: a replica refuses it, in its own words
            token = SHAPES[call.api].token_param
            params = [(k, INVALID_PAGE_TOKEN if k == token else v) for k, v in raw.query_params.multi_items()]
            path = raw.url.path + (f"?{urlencode(params)}" if params else "")
            answer, attempt = await self._answer(ForwardedRequest("GET", path, headers, b""))
            if answer is None:
                return self._unanswered()
            return Response(answer.body, status_code=answer.status, headers=_answer_headers(answer, attempt))
        start = dict.fromkeys(await self._live_replicas()) if query.cursor is None else query.cursor

        async def fetch(rid: str, token: str | None) -> ReplicaPage | ForwardedResponse | None:
            return await self._page(call, raw.url.path, headers, rid, token, query.size)

        # on a first page, a replica the request router reported meanwhile and not yet asked (it just started)
        late = (lambda: self._live) if query.cursor is None else None
        pages, refused = await gather_pages(start, fetch, late)
        if refused:  # every replica refuses alike (a bad key, a bad size): the first one's answer
            first: ForwardedResponse = refused[0]
            return Response(first.body, status_code=first.status, headers=_answer_headers(first, 0))
        rows, after = merge_pages(call.api, pages, query.size)
        answered = {REPLICA_HEADER: ",".join(sorted(pages)), RETRIES_HEADER: "0"}
        return JSONResponse(listing_body(call.api, rows, after), headers=answered)

    async def _page(
        self, call: CacheCall, path: str, headers: list[tuple[str, str]], rid: str, token: str | None, size: int
    ) -> ReplicaPage | ForwardedResponse | None:
        """Replica `rid`'s page from its own `token`: its rows, or its refusal (not 200), or None when it is gone
        (lost, or another replica answered for it: its entries went with it)."""
        shape = SHAPES[call.api]
        params = {shape.size_param: str(size), **({shape.token_param: token} if token is not None else {})}
        route = RouteRequest(token_ids=[], target_replica=rid)
        try:
            answer: ForwardedResponse = await self._replicas.handle.remote(
                ForwardedRequest("GET", f"{path}?{urlencode(params)}", headers, b"", route)
            )
        except _REPLICA_LOST as exc:
            self.stats.gone(exc, "listing cache entries")
            return None
        self._saw(route)
        answered = _lower(answer.headers)
        if answered.get(REPLICA_HEADER) != rid:
            return None
        if answer.status != 200:
            return answer
        return replica_page(call.api, token, answer.body, answered.get(PAGE_TOKENS_HEADER))

    async def _stream(self, request: ForwardedRequest) -> Response:
        for attempt in range(MAX_ATTEMPTS):
            chunks: Any = self._streaming.handle_stream.remote(request)
            try:
                head: ForwardedResponse = await chunks.__anext__()
            except _REPLICA_LOST as exc:
                self.stats.lost(exc, attempt, "before streaming")
                continue
            self._saw(request.route)
            headers = _answer_headers(head, attempt)
            replica = _lower(head.headers).get(REPLICA_HEADER, "")
            router_view.stream_opened(replica)  # counted open until its last chunk (router_view.py says why)
            return StreamingResponse(self._rest(chunks, replica), status_code=head.status, headers=headers)
        return self._unanswered()

    def _unanswered(self) -> Response:
        self.stats.unanswered += 1
        return JSONResponse(_error(503, "no engine replica could answer the request"), status_code=503)

    async def _rest(self, chunks: Any, replica: str) -> AsyncIterator[bytes]:
        """The body chunks after the head; a replica lost mid-stream ends it with an error event and [DONE]. A
        client that goes away closes this generator early: the replica's call is cancelled, so its app sees the
        disconnect and the engine aborts the request (Ray would otherwise run the generator to its end)."""
        finished = False
        try:
            async for chunk in chunks:
                yield chunk
            finished = True
        except _REPLICA_LOST as exc:
            finished = True
            self.stats.streams_cut += 1
            self.stats.lost_attempts[getattr(exc, "actor_id", None) or "unknown"] += 1
            logger.warning("replica lost mid-stream: %s", exc)
            yield f"data: {json.dumps(_error(503, 'the engine replica was lost mid-stream'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            router_view.stream_closed(replica)
            if not finished:
                chunks.cancel()
