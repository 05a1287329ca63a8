"""The one builder of a request's options at the HTTP doors: every generating route's body fields and the headers
every route honours go through here, so no dialect can forget one.

The route passes what its own body says (sampling, priority, the client's cache salt and user, the grouping
hint, retention, prewarm); this adds what belongs to the HTTP request rather than to any API's body: the tenant
bound into the cache salt (auth.py), the agent-session headers (session_hints.py) and a router's
held-elsewhere hint (router_hints.py), and, for an API the server clamps (--clamp-max-tokens), a max_tokens
lowered to what fits instead of a 400. A bad value is a 400 in the route's error shape.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from fastapi import Request

from prefixkv.request_options import NO_RETENTION, RequestOptions, Retention
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.auth import cache_salt_for
from prefixkv.server.errors import from_value_error
from prefixkv.server.router_hints import held_elsewhere_tokens
from prefixkv.server.session_hints import session_hint

if TYPE_CHECKING:
    from prefixkv.server.state import ServerState


class CacheFields(Protocol):
    """The body fields the OpenAI-shaped and Anthropic routes share (protocol.py, responses_protocol.py,
    messages_protocol.py)."""

    @property
    def user(self) -> str | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def priority(self) -> int: ...


def body_options(
    state: ServerState,
    raw: Request,
    body: CacheFields,
    sampling: SamplingParams,
    retention: Retention = NO_RETENTION,
    prefill_only: bool = False,
    *,
    api: str,
) -> RequestOptions:
    """request_options for a body with the shared cache fields (and OpenAI's prompt_cache_key where it has one)."""
    return request_options(
        state,
        raw,
        sampling,
        user=body.user,
        cache_salt=body.cache_salt,
        priority=body.priority,
        prompt_cache_key=getattr(body, "prompt_cache_key", None),
        retention=retention,
        prefill_only=prefill_only,
        api=api,
    )


def request_options(
    state: ServerState,
    raw: Request,
    sampling: SamplingParams,
    *,
    user: str | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    prompt_cache_key: str | None = None,
    retention: Retention = NO_RETENTION,
    prefill_only: bool = False,
    api: str | None = None,
) -> RequestOptions:
    """api: the route's API (options.CLAMP_APIS), None where no client's max_tokens is in play (prewarm)."""
    if api in state.clamp_max_tokens:
        sampling = dataclasses.replace(sampling, clamp_max_tokens=True)
    try:
        return RequestOptions(
            sampling,
            priority=priority,
            cache_salt=cache_salt_for(state.tenant_isolation, raw, user, cache_salt),
            retention=retention,
            session=session_hint(raw),
            prompt_cache_key=prompt_cache_key,
            held_elsewhere_tokens=held_elsewhere_tokens(raw),
            prefill_only=prefill_only,
        )
    except ValueError as exc:
        raise from_value_error(exc) from None
