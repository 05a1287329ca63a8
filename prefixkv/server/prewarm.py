"""POST /v1/cache/prewarm: compute and cache a prompt's KV without generating (prefixkv/prewarm.py explains it).

Body: {"prompt": text or token ids} or {"messages": [...]} (templated as a chat request's would be), with the
cache fields of the generation endpoints: cache_salt / user (tenant isolation as configured: a tenant warms its
own namespace only), prompt_cache_key, prompt_cache_retention. Answer: {"prompt_tokens", "cached_tokens"}: the
prompt's length and how many of its tokens are cached now (whole pages), plus the hit it found on arrival.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from prefixkv.outputs import RequestOutput
from prefixkv.prewarm import PREWARM_PARAMS
from prefixkv.request_options import RequestOptions, Retention
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.protocol import PromptCacheFields, template_messages
from prefixkv.server.request_options import request_options
from prefixkv.server.state import ServerState, record_prompt_cache_key, server_state

router = APIRouter()


class PrewarmRequest(PromptCacheFields):
    model: str | None = None
    prompt: str | list[int] | None = Field(None, description="text or token ids; exactly one of prompt, messages")
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    cache_salt: str | None = None
    user: str | None = None


@router.post("/v1/cache/prewarm")
async def prewarm_cache(body: PrewarmRequest, raw: Request) -> dict:
    state = server_state(raw)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value")
    if body.messages is not None:
        prompt: Any = await state.tokenize_chat(template_messages(body.messages))
    else:
        if not body.prompt:
            raise APIError("prompt must not be empty", param="prompt", code="invalid_value")
        (prompt,) = await state.tokenize([body.prompt])
    options = request_options(
        state,
        raw,
        PREWARM_PARAMS,
        user=body.user,
        cache_salt=body.cache_salt,
        prompt_cache_key=body.prompt_cache_key,
        retention=body.retention(),
        prefill_only=True,
    )
    request_id = f"prewarm-{uuid.uuid4().hex}"
    record_prompt_cache_key(state, request_id, body.prompt_cache_key)
    final = await warm(state, request_id, prompt, options)
    cached = await state.engine.cached_prompt_tokens(prompt, options.cache_salt)
    return {
        "id": request_id,
        "object": "cache.prewarm",
        "model": state.served_model_name,
        "prompt_tokens": len(final.prompt_token_ids),
        "cached_tokens": cached,
        "hit_tokens": final.num_cached_tokens,  # what was cached already when it arrived
    }


def warm_options(cache_salt: str | None, retention: Retention) -> RequestOptions:
    """A prefill-only request's options in a namespace already derived (a /v1/caches entry's)."""
    return RequestOptions(PREWARM_PARAMS, cache_salt=cache_salt, retention=retention, prefill_only=True)


async def warm(state: ServerState, request_id: str, prompt: Any, options: RequestOptions) -> RequestOutput:
    """Compute and cache `prompt` as a prefill-only request with these options; its final output. Engine
    rejections (bad ids, too long) become 400s. /v1/caches creates and extends entries with it."""
    try:
        group = await state.engine.submit([request_id], [prompt], [options], stream=False)
    except ValueError as exc:
        raise from_value_error(exc) from None
    try:
        (final,) = await group.collect()
    finally:
        group.close()
    return final
