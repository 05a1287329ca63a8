"""`cached_content` on the generation routes: a request served on top of a /v1/caches entry (cache_store.py).

The entry's prefix comes first: on /v1/completions (a "prompt" entry) the prompt is the entry's tokens and then
the request's own; on the chat routes (a "messages" entry) the conversation is the entry's messages and then the
request's, rendered by the same template, so its KV is the entry's. Each use also retains the prefix until the
entry's expiry (a retention span), so a prefix evicted under pressure and computed again stays held after use.

Another owner's name, an unknown or expired one, the wrong kind or another cache salt is a 400 naming
`cached_content`, in the route's own error shape (errors.py), and changes nothing.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from prefixkv.engine.prompts import shared_prefix
from prefixkv.request_options import Retention
from prefixkv.server.auth import cache_salt_for, principal_of, request_api_key, tenant_owner
from prefixkv.server.cache_store import CacheEntry, entry_id_of
from prefixkv.server.errors import APIError
from prefixkv.server.messages_protocol import Conversation
from prefixkv.server.state import ServerState

ENTRY_RETENTION_PRIORITY = 1  # as prompt_cache_retention "24h": above plain requests' retention
_ROUTES = {"prompt": "/v1/completions", "messages": "/v1/chat/completions, /v1/messages or /v1/responses"}


def owner_of(state: ServerState, raw: Request, user: str | None) -> str | None:
    """Whose entries a caller sees: the tenant, as tenant isolation names it (None: isolation off)."""
    return tenant_owner(state.tenant_isolation, principal_of(raw), request_api_key(raw), user)


def entry_for(
    state: ServerState, raw: Request, name: str | None, kind: str, user: str | None, cache_salt: str | None
) -> CacheEntry | None:
    """The caller's live entry `name` (None when no name is given); 400 when it cannot serve this request."""
    if name is None:
        return None
    entry = state.caches.get(entry_id_of(name), owner_of(state, raw, user))
    if entry is None:
        raise APIError(
            f"Cached content '{name}' not found (unknown, expired or deleted)",
            param="cached_content",
            code="cached_content_not_found",
        )
    if entry.kind != kind:
        raise APIError(
            f"Cached content '{name}' holds {entry.kind}; use it on {_ROUTES[entry.kind]}",
            param="cached_content",
            code="invalid_value",
        )
    if cache_salt_for(state.tenant_isolation, raw, user, cache_salt) != entry.cache_salt:
        raise APIError(
            f"Cached content '{name}' was created with another cache_salt (or user); send the same ones",
            param="cached_content",
            code="invalid_value",
        )
    return entry


async def prefixed_prompts(state: ServerState, entry: CacheEntry, prompts: list) -> list[str | list[int]]:
    """Each prompt's token ids after the entry's (text is tokenized on its own, then appended)."""
    out: list[str | list[int]] = []
    for p in await state.tokenize(prompts):
        ids = p["prompt_token_ids"] if isinstance(p, dict) else p
        combined = [*entry.token_ids, *ids]
        state.check_prompt_tokens(len(combined), "prompt")
        out.append(combined)
    return out


def prefixed_conversation(entry: CacheEntry, conversation: Conversation) -> Conversation:
    """The entry's messages, then the conversation's; its breakpoints move with their messages."""
    k = len(entry.messages)
    breakpoints = [bp if bp.message is None else replace(bp, message=bp.message + k) for bp in conversation.breakpoints]
    return Conversation([*entry.messages, *conversation.messages], breakpoints)


def use_retention(entry: CacheEntry | None, retention: Retention, prompt: list[int] | None = None) -> Retention:
    """The retention of a request on top of `entry`: its own, plus the entry's prefix (the tokens the prompt
    shares with it) retained until the entry expires."""
    if entry is None:
        return retention
    prefix = len(entry.token_ids) if prompt is None else shared_prefix(entry.token_ids, prompt)
    seconds = entry.seconds_left()
    if prefix < 1 or seconds <= 0:
        return retention
    return Retention(
        retention.seconds,
        max(retention.priority, ENTRY_RETENTION_PRIORITY),
        (*retention.spans, (prefix, seconds)),
    )
