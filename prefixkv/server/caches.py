"""/v1/caches: cache entries as a resource, shaped like Gemini's cachedContents (create, list, get, extend, delete).

An entry is a prefix (chat messages, or a prompt) that the server computes once and keeps retained until its
expiry; a request that names it (`cached_content`, cached_content.py) is served on top of it. Creating one is a
prewarm with retention (prewarm.py) at priority 1 until the expiry, so the entry lives within
--retained-pool-fraction like every retained prefix: one that could never be held whole is refused. Changing the
expiry (PATCH) ends the old retention and prewarms again, so evicted pages come back and stay until the new
expiry; deleting ends the retention at once (the pages another live entry of the owner shares stay retained).

The steps that create, re-expire and delete an entry (add_entry, change_expiry, remove_entry) also serve Gemini's
own /v1beta/cachedContents (gemini.py): one store, either API's names.

Per owner (tenant isolation's, as stored responses are): another tenant's entry is not found (404); an admin key,
or a server without keys, sees every entry and may change or delete it, and its listing names each one's tenant.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from prefixkv.request_options import Retention
from prefixkv.server.auth import cache_salt_for, principal_of
from prefixkv.server.cache_store import ID_PREFIX, PAGE_TOKENS_HEADER, CacheEntry, CacheStoreFull, entry_id_of
from prefixkv.server.cached_content import ENTRY_RETENTION_PRIORITY, owner_of
from prefixkv.server.errors import APIError
from prefixkv.server.prewarm import warm, warm_options
from prefixkv.server.protocol import MAX_PROMPT_CACHE_KEY_CHARS, template_messages
from prefixkv.server.state import ServerState, server_state

router = APIRouter()

DEFAULT_TTL_SECONDS = 3600.0  # Gemini's default
MAX_TTL_SECONDS = 365 * 86400.0
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)s\s*$")  # protobuf's JSON Duration: "300s", "1.5s"
_TTL = "a duration as Gemini writes it ('300s', '1.5s') or a number of seconds; > 0, at most a year"
_EXPIRE = "an RFC 3339 time with a zone ('2026-12-01T12:00:00Z'), in the future, within a year"


class CreateCacheRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    messages: list[dict[str, Any]] | None = Field(
        None,
        min_length=1,
        description="chat messages (templated as a chat request's conversation, without a "
        "generation prompt); exactly one of messages, prompt",
    )
    prompt: str | list[Annotated[int, Field(ge=0)]] | None = Field(None, description="text or token ids")
    ttl: str | float | None = Field(None, description=_TTL + "; default 3600s; not with expire_time")
    expire_time: str | None = Field(None, max_length=64, description=_EXPIRE + "; not with ttl")
    display_name: str | None = Field(None, max_length=128)
    cache_salt: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = Field(
        None,
        max_length=MAX_PROMPT_CACHE_KEY_CHARS,
        description="with --replicas, the session key the ingress places the entry by; one server only accepts it",
    )


class UpdateCacheRequest(BaseModel):
    model_config = _STRICT

    ttl: str | float | None = Field(None, description=_TTL + "; exactly one of ttl, expire_time")
    expire_time: str | None = Field(None, max_length=64, description=_EXPIRE)


@router.post("/v1/caches")
async def create_cache(body: CreateCacheRequest, raw: Request) -> dict:
    state = server_state(raw)
    model = state.check_model(body.model)
    check_caching(state)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value")
    now = time.time()
    expire_time = expiry(body.ttl, body.expire_time, now, default=DEFAULT_TTL_SECONDS)
    owner = owner_of(state, raw, body.user)
    check_room(state, owner)
    messages: tuple[dict[str, str], ...] = ()
    if body.messages is not None:
        messages = tuple(template_messages(body.messages))
        token_ids = await state.tokenize_chat(list(messages), add_generation_prompt=False)
        kind = "messages"
    else:
        if not body.prompt:
            raise APIError("prompt must not be empty", param="prompt", code="invalid_value")
        (prompt,) = await state.tokenize([body.prompt])
        token_ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        state.check_prompt_tokens(len(token_ids), "prompt")
        kind = "prompt"
    salt = cache_salt_for(state.tenant_isolation, raw, body.user, body.cache_salt)
    entry = CacheEntry(
        id=ID_PREFIX + uuid.uuid4().hex,
        owner=owner,
        cache_salt=salt,
        kind=kind,
        token_ids=tuple(token_ids),
        messages=messages,
        model=model,
        display_name=body.display_name,
        create_time=now,
        update_time=now,
        expire_time=expire_time,
    )
    await add_entry(state, entry, param="messages" if kind == "messages" else "prompt")
    return await _body(state, raw, entry)


async def add_entry(state: ServerState, entry: CacheEntry, param: str) -> None:
    """Compute and retain `entry`'s prefix until its expiry, then store it (also /v1beta/cachedContents, gemini.py).
    400 (naming `param`) when its pages could never be held whole, or when the store filled up meanwhile."""
    token_ids = list(entry.token_ids)
    summary, _ = await state.engine.cache_summary()
    pages = len(token_ids) // state.page_size
    if pages > summary.retained_capacity:
        raise APIError(
            f"the entry's {len(token_ids)} tokens fill {pages} KV pages, more than the {summary.retained_capacity} "
            "this server may keep retained (--retained-pool-fraction of the pool): it could never be held whole",
            param=param,
            code="cache_too_large",
        )
    await warm(state, f"prewarm-{entry.id}", token_ids, warm_options(entry.cache_salt, _retention(entry.expire_time)))
    try:
        state.caches.add(entry)
    except CacheStoreFull as exc:  # filled up while this one was computed: let its pages go again
        await state.engine.release_retention(token_ids, entry.cache_salt, 0)
        raise APIError(str(exc), code="too_many_caches") from None


@router.get("/v1/caches")
async def list_caches(
    raw: Request,
    response: Response,
    page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
    page_token: Annotated[str | None, Query(max_length=32)] = None,
) -> dict:
    """Newest first; next_page_token (null on the last page) asks for the entries after this page (and the
    PAGE_TOKENS_HEADER header gives each row's)."""
    state = server_state(raw)
    before = None
    if page_token is not None:
        if not page_token.isdigit() or int(page_token) < 1:
            raise APIError("page_token is not one this server gave out", param="page_token", code="invalid_value")
        before = int(page_token)
    admin = principal_of(raw).is_admin
    rows = state.caches.listing(owner_of(state, raw, None), admin, before)
    page = rows[:page_size]
    cached = await state.engine.cached_prompt_tokens_of([(list(e.token_ids), e.cache_salt) for e in page])
    more = len(rows) > page_size
    response.headers[PAGE_TOKENS_HEADER] = ",".join(str(e.seq) for e in page)
    return {
        "object": "list",
        "data": [e.body(n, with_tenant=admin) for e, n in zip(page, cached, strict=True)],
        "next_page_token": str(page[-1].seq) if more else None,
    }


@router.get("/v1/caches/{cache_id:path}")
async def get_cache(cache_id: str, raw: Request) -> dict:
    state = server_state(raw)
    return await _body(state, raw, _visible(state, raw, cache_id))


@router.patch("/v1/caches/{cache_id:path}")
async def update_cache(cache_id: str, body: UpdateCacheRequest, raw: Request) -> dict:
    """A new expiry, later or earlier: the entry's own retention ends and is taken again up to it (a prewarm, so
    pages evicted meanwhile are computed again)."""
    state = server_state(raw)
    entry = _visible(state, raw, cache_id)
    if (body.ttl is None) == (body.expire_time is None):
        raise APIError("give exactly one of 'ttl' and 'expire_time'", param="ttl", code="invalid_value")
    if not await change_expiry(state, entry, expiry(body.ttl, body.expire_time, time.time())):
        raise _not_found(cache_id)
    return await _body(state, raw, entry)


async def change_expiry(state: ServerState, entry: CacheEntry, expire_time: float) -> bool:
    """End the entry's retention and take it again up to `expire_time`; False when it was deleted meanwhile."""
    await state.engine.release_retention(list(entry.token_ids), entry.cache_salt, state.caches.kept_prefix(entry))
    await warm(
        state,
        f"prewarm-{entry.id}-{uuid.uuid4().hex[:8]}",
        list(entry.token_ids),
        warm_options(entry.cache_salt, _retention(expire_time)),
    )
    if state.caches.set_expiry(entry.id, expire_time) is None:  # deleted meanwhile: its retention goes too
        await state.engine.release_retention(list(entry.token_ids), entry.cache_salt, state.caches.kept_prefix(entry))
        return False
    return True


@router.delete("/v1/caches/{cache_id:path}")
async def delete_cache(cache_id: str, raw: Request) -> dict:
    """Gone at once: its pages' retention ends now (they stay cached as ordinary pages until evicted)."""
    state = server_state(raw)
    entry = _visible(state, raw, cache_id)
    if not await remove_entry(state, entry):
        raise _not_found(cache_id)
    return {"id": entry.id, "object": "cache.deleted", "deleted": True}


async def remove_entry(state: ServerState, entry: CacheEntry) -> bool:
    """Drop the entry and release its retention at once; False when it was gone already."""
    if state.caches.remove(entry.id) is None:
        return False
    await state.engine.release_retention(list(entry.token_ids), entry.cache_salt, state.caches.kept_prefix(entry))
    return True


def visible_entry(state: ServerState, raw: Request, cache_id: str) -> CacheEntry | None:
    """The live entry `cache_id` names (an id or a name) if the caller may see it (an admin sees every one)."""
    return state.caches.get(entry_id_of(cache_id), owner_of(state, raw, None), principal_of(raw).is_admin)


def _visible(state: ServerState, raw: Request, cache_id: str) -> CacheEntry:
    entry = visible_entry(state, raw, cache_id)
    if entry is None:
        raise _not_found(cache_id)
    return entry


def _not_found(cache_id: str) -> APIError:
    return APIError(f"Cache '{cache_id}' not found", status=404, param="cache_id", code="not_found")


async def _body(state: ServerState, raw: Request, entry: CacheEntry) -> dict:
    cached = await state.engine.cached_prompt_tokens(list(entry.token_ids), entry.cache_salt)
    return entry.body(cached, with_tenant=principal_of(raw).is_admin)


def check_caching(state: ServerState) -> None:
    if not state.prefix_caching:
        raise APIError("prefix caching is off on this server: no cache can keep an entry", code="unsupported")


def check_room(state: ServerState, owner: str | None) -> None:
    """400 unless the store has room for one more entry of `owner`."""
    try:
        state.caches.check_room(owner)
    except CacheStoreFull as exc:
        raise APIError(str(exc), code="too_many_caches") from None


def _retention(expire_time: float) -> Retention:
    return Retention(max(expire_time - time.time(), 0.0), ENTRY_RETENTION_PRIORITY)


def expiry(
    ttl: str | float | None,
    expire_time: str | None,
    now: float,
    default: float | None = None,
    expire_field: str = "expire_time",
) -> float:
    """The expiry (wall-clock seconds) from a ttl or an expire_time, at most one of them; 400s name the field
    (expire_field: as the route's API spells it)."""
    if ttl is not None and expire_time is not None:
        raise APIError(f"give 'ttl' or '{expire_field}', not both", param="ttl", code="invalid_value")
    if expire_time is not None:
        try:
            when = datetime.fromisoformat(expire_time)
        except ValueError:
            when = None
        seconds = math.nan if when is None or when.tzinfo is None else when.timestamp() - now
        if not 0 < seconds <= MAX_TTL_SECONDS:  # NaN fails too
            raise APIError(
                f"{expire_field} must be {_EXPIRE}; got {expire_time!r}", param="expire_time", code="invalid_value"
            )
        return now + seconds
    if ttl is None:
        assert default is not None
        return now + default
    if isinstance(ttl, str):
        match = _DURATION.match(ttl)
        seconds = float(match.group(1)) if match else math.nan
    else:
        seconds = float(ttl)
    if not 0 < seconds <= MAX_TTL_SECONDS:  # NaN fails too
        raise APIError(f"ttl must be {_TTL}; got {ttl!r}", param="ttl", code="invalid_value")
    return now + seconds
