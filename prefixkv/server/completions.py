"""POST /v1/completions: raw prompts (text or token ids, one or many) in, text completions out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from prefixkv.outputs import RequestOutput
from prefixkv.server.cached_content import entry_for, prefixed_prompts, use_retention
from prefixkv.server.deltas import choice_deltas
from prefixkv.server.logprobs import completion_logprobs
from prefixkv.server.protocol import CompletionRequest
from prefixkv.server.request_options import body_options
from prefixkv.server.sse import answer, sse
from prefixkv.server.state import ServerState, server_state, submit
from prefixkv.server.usage import UsageTally, usage

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request):
    state = server_state(raw)
    model = state.check_model(body.model)
    prompts = body.prompts(state.max_prompts_per_request, state.max_n)
    params = body.sampling_params()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    entry = entry_for(state, raw, body.cached_content, "prompt", body.user, body.cache_salt)
    if entry is not None:  # served on top of a /v1/caches entry: its tokens, then each prompt's
        prompts = await prefixed_prompts(state, entry, prompts)
    options = body_options(state, raw, body, params, use_retention(entry, body.retention()), api="completions")
    group = await submit(state, request_id, prompts, options, body.stream)
    created = int(time.time())
    events = _stream(state, body, group, request_id, model, created) if body.stream else None
    return await answer(raw, group, events, lambda finals: _response(state, body, finals, request_id, model, created))


def _response(
    state: ServerState, body: CompletionRequest, finals: list[RequestOutput], request_id: str, model: str, created: int
) -> dict:
    choices: list[dict[str, Any]] = []
    for prompt_index, output in enumerate(finals):
        for c in output.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(state.tokenizer, list(c.logprobs or []), 0)
            choices.append(
                {
                    "index": prompt_index * body.n + c.index,
                    "text": c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    choices.sort(key=lambda ch: ch["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(finals, body.explain_cache_miss),
    }


async def _stream(
    state: ServerState, body: CompletionRequest, group, request_id: str, model: str, created: int
) -> AsyncIterator[str]:
    tally = UsageTally(body.explain_cache_miss)
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    async for d in choice_deltas(group, body.n, tally):
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(state.tokenizer, d.logprobs, d.text_offset)
        choice = {
            "index": d.index,
            "text": d.text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        yield sse({**base, "choices": [choice]})
    if body.include_usage:
        yield sse({**base, "choices": [], "usage": tally.usage()})
