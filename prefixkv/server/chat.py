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
from prefixkv.server.errors import APIError
from prefixkv.server.logprobs import chat_logprobs
from prefixkv.server.openai_tools import chat_call
from prefixkv.server.protocol import ChatCompletionRequest
from prefixkv.server.request_options import body_options
from prefixkv.server.sse import answer, sse
from prefixkv.server.state import ServerState, server_state, submit
from prefixkv.server.usage import UsageTally, usage
from prefixkv.tools.parse import CallStream, StreamEvent, split_answer

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    state = server_state(raw)
    model = state.check_model(body.model)
    params = body.sampling_params(state.max_n)
    messages = body.template_messages()
    entry = entry_for(state, raw, body.cached_content, "messages", body.user, body.cache_salt)
    if entry is not None and body.tool_spec[0]:
        raise APIError("tools cannot be combined with cached_content", param="tools", code="unsupported")
    if entry is not None:  # served on top of a /v1/caches entry: its messages, then the request's
        messages = [*entry.messages, *messages]
    prompt = await state.tokenize_chat(messages)  # templated and tokenized in a worker thread
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    options = body_options(state, raw, body, params, use_retention(entry, body.retention(), prompt), api="chat")
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
        message: dict = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if body.reads_calls:  # a call cut short by max_tokens is dropped, as the stream drops it
            text, calls = split_answer(c.text, call_id)
            message = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = [chat_call(x) for x in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
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
    readers = {index: CallStream(call_id) for index in range(body.n)} if body.reads_calls else {}
    called: set[int] = set()
    async for d in choice_deltas(group, body.n, tally):
        logprobs = chat_logprobs(state.tokenizer, d.logprobs) if body.logprobs else None
        finish_reason = d.finish_reason
        if d.index in readers:
            reader = readers[d.index]
            events = reader.feed(d.text) + (reader.finish() if finish_reason else [])
            if reader.calls:
                called.add(d.index)
            if finish_reason == "stop" and d.index in called:
                finish_reason = "tool_calls"
            deltas = [_call_delta(e) for e in events] or [{}]
        else:
            deltas = [{"content": d.text} if d.text else {}]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            yield sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": logprobs if last else None,
                            "finish_reason": finish_reason if last else None,
                            "stop_reason": d.stop_reason if last else None,
                        }
                    ],
                }
            )
    if body.include_usage:
        yield sse({**base, "choices": [], "usage": tally.usage()})


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_delta(event: StreamEvent) -> dict:
    """A stream event as Chat Completions' delta: content, or a tool call's opening (id, name) or arguments."""
    if event.kind == "text":
        return {"content": event.text}
    if event.kind == "call":
        opening = {"name": event.text, "arguments": ""}
        return {"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function", "function": opening}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
