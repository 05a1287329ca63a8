"""POST /v1/chat/completions: messages go through the model's chat template, then generate like a completion.

The engine gets token ids (Tokenizer.encode_chat): a repeated system prompt tokenises to the same leading tokens
every time, so its KV is found in the prefix cache; and special-token text a client types into a message stays
plain text (it cannot forge a turn) unless the server runs with --allow-special-tokens-in-content.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from prefixkv.outputs import RequestOutput
from prefixkv.server.cached_content import entry_for, use_retention
from prefixkv.server.deltas import choice_deltas
from prefixkv.server.logprobs import chat_logprobs
from prefixkv.server.protocol import ChatCompletionRequest
from prefixkv.server.request_options import body_options
from prefixkv.server.sse import answer, sse
from prefixkv.server.state import ServerState, server_state, submit
from prefixkv.server.usage import UsageTally, usage

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    state = server_state(raw)
    model = state.check_model(body.model)
    params = body.sampling_params(state.max_n)
    messages = body.template_messages()
    entry = entry_for(state, raw, body.cached_content, "messages", body.user, body.cache_salt)
    if entry is not None:  # served on top of a /v1/caches entry: its messages, then the request's
        messages = [*entry.messages, *messages]
    prompt = await state.tokenize_chat(messages)  # templated and tokenized in a worker thread
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    options = body_options(state, raw, body, params, use_retention(entry, body.retention(), prompt))
    group = await submit(state, request_id, [prompt], options, body.stream)
    created = int(time.time())
    events = _stream(state, body, group, request_id, model, created) if body.stream else None
    return await answer(
        raw, group, events, lambda finals: _response(state, body, finals[0], request_id, model, created)
    )


def _response(
    state: ServerState, body: ChatCompletionRequest, final: RequestOutput, request_id: str, model: str, created: int
) -> dict:
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        logprobs = chat_logprobs(state.tokenizer, list(c.logprobs or [])) if body.logprobs else None
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage([final], body.explain_cache_miss),
    }


async def _stream(
    state: ServerState, body: ChatCompletionRequest, group, request_id: str, model: str, created: int
) -> AsyncIterator[str]:
    tally = UsageTally(body.explain_cache_miss)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    for index in range(body.n):  # OpenAI opens every choice with the role
        yield sse(
            {
                **base,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
    async for d in choice_deltas(group, body.n, tally):
        delta = {"content": d.text} if d.text else {}
        logprobs = chat_logprobs(state.tokenizer, d.logprobs) if body.logprobs else None
        yield sse(
            {
                **base,
                "choices": [
                    {
                        "index": d.index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": d.finish_reason,
                        "stop_reason": d.stop_reason,
                    }
                ],
            }
        )
    if body.include_usage:
        yield sse({**base, "choices": [], "usage": tally.usage()})
