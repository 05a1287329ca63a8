"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same engine.

The conversation goes through the model's chat template like /v1/chat/completions; each cache breakpoint
(messages_protocol.py) becomes a retention span, so the prefix up to it stays cached for its TTL, and a hit
refreshes it. Errors on these routes come in Anthropic's shape (errors.py); keys may come as `x-api-key`.

`usage`, exact on every request (input_tokens + cache_read_input_tokens + cache_creation_input_tokens = the prompt),
from the engine's counts, never from a formula over the prompt's length:
- cache_read_input_tokens: prompt tokens served from the cache (RequestOutput.num_cached_tokens);
- cache_creation_input_tokens: prompt tokens this request wrote into the cache itself, as the engine counted its
  inserts (RequestOutput.cache_writes: whole pages past the hit that were not cached before). A page a duplicate
  request in flight, or an earlier one, inserted first is not this request's write, nor is anything with the
  cache off. In cache_creation.ephemeral_1h_input_tokens the written pages wholly inside a 1h breakpoint's
  prefix (the pages that breakpoint retains for the hour), the rest in ephemeral_5m;
- input_tokens: the rest: the tail of the prompt that fills no whole page, and pages computed but not written
  (a prompt's last token is always computed, so a wholly cached prompt that ends on a page boundary computes its
  last page again, and that page was cached already: input, not a write).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request

from prefixkv.cache_miss import CacheMiss
from prefixkv.outputs import RequestOutput
from prefixkv.request import CacheWrites
from prefixkv.request_options import Retention
from prefixkv.server.cached_content import entry_for, prefixed_conversation, use_retention
from prefixkv.server.errors import APIError
from prefixkv.server.messages_protocol import (
    CACHE_TTL_SECONDS,
    CountTokensRequest,
    MessagesRequest,
)
from prefixkv.server.request_options import body_options
from prefixkv.server.sse import answer, sse
from prefixkv.server.state import ServerState, server_state, submit
from prefixkv.tools.parse import CallStream, StreamEvent, split_answer

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request):
    state = server_state(raw)
    model = state.check_model(body.model)
    conversation = body.conversation()
    params = body.sampling_params()
    entry = entry_for(state, raw, body.cached_content, "messages", body.user, body.cache_salt)
    if entry is not None:  # served on top of a /v1/caches entry: its messages, then the request's
        conversation = prefixed_conversation(entry, conversation)
    prompt, positions = await state.tokenize_conversation(conversation)
    spans = [
        (pos, CACHE_TTL_SECONDS[bp.ttl]) for bp, pos in zip(conversation.breakpoints, positions, strict=True) if pos
    ]
    message_id = f"msg_{uuid.uuid4().hex}"
    retention = use_retention(entry, Retention(spans=tuple(spans)), prompt)
    options = body_options(state, raw, body, params, retention, prefill_only=body.max_tokens == 0, api="messages")
    group = await submit(state, message_id, [prompt], options, body.stream)
    accounting = _Accounting(state, len(prompt), spans)
    accounting.explain_cache_miss = body.explain_cache_miss
    calls = body.reads_calls
    if body.stream:
        events = _stream(group, message_id, model, accounting, calls)
        return await answer(raw, group, events, error_event=_error_event, done=None)
    return await answer(raw, group, None, lambda finals: _message(finals[0], message_id, model, accounting, calls))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request):
    """The prompt /v1/messages would build for the same fields: a cached_content's messages first, found (or
    refused, with the same 400) as /v1/messages finds it."""
    state = server_state(raw)
    state.check_model(body.model)
    conversation = body.conversation()
    entry = entry_for(state, raw, body.cached_content, "messages", body.user, body.cache_salt)
    if entry is not None:
        conversation = prefixed_conversation(entry, conversation)
    prompt, _ = await state.tokenize_conversation(conversation)
    return {"input_tokens": len(prompt)}


class _Accounting:
    """The request's usage block from the engine's counts (module docstring)."""

    def __init__(self, state: ServerState, prompt_tokens: int, spans: Sequence[tuple[int, float]]) -> None:
        self.prompt_tokens = prompt_tokens
        hour = CACHE_TTL_SECONDS["1h"]
        hour_end = max((pos for pos, seconds in spans if seconds >= hour), default=0)
        self.hour_pages_end = hour_end // state.page_size * state.page_size  # the 1h span retains whole pages
        self.explain_cache_miss = False

    def usage(self, cached: int, writes: CacheWrites, output_tokens: int, miss: CacheMiss | None = None) -> dict:
        """Anthropic's usage from the engine's counts (an output's num_cached_tokens and cache_writes, the newest:
        each output carries them whole); with explain_cache_miss asked (prefixkv's extension) and `miss` known,
        cache_miss."""
        cached = max(0, cached)
        written = writes.tokens
        written_1h = writes.tokens_below(self.hour_pages_end)
        out = {
            "input_tokens": self.prompt_tokens - cached - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": cached,
            "cache_creation": {
                "ephemeral_5m_input_tokens": written - written_1h,
                "ephemeral_1h_input_tokens": written_1h,
            },
            "output_tokens": output_tokens,
        }
        if self.explain_cache_miss and miss is not None:
            out["cache_miss"] = miss.to_json()
        return out


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _stop(output: RequestOutput, called: bool = False) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) from the engine's finish; tool_use when it ended on calls."""
    completion = output.outputs[0]
    if completion.finish_reason == "stop" and called:
        return "tool_use", None
    if completion.finish_reason == "stop":
        if isinstance(completion.stop_reason, str):
            return "stop_sequence", completion.stop_reason
        return "end_turn", None
    return "max_tokens", None


def _message(final: RequestOutput, message_id: str, model: str, accounting: _Accounting, reads_calls: bool) -> dict:
    completion = final.outputs[0]
    text, calls = split_answer(completion.text, tool_use_id) if reads_calls else (completion.text, [])
    content: list[dict] = [{"type": "text", "text": text}] if text or (completion.token_ids and not calls) else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in calls]
    stop_reason, stop_sequence = _stop(final, bool(calls))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": accounting.usage(
            final.num_cached_tokens, final.cache_writes, len(completion.token_ids), final.cache_miss
        ),
    }


def _error_event(err: APIError) -> str:
    return sse(err.anthropic_body(), event="error")


async def _stream(group, message_id: str, model: str, accounting: _Accounting, reads_calls: bool) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start; each content block (a text block, then one tool_use block per
    call: start, deltas (text_delta, input_json_delta), stop); message_delta with the stop reason and the usage;
    message_stop. message_start waits for the engine's first output, which comes once the prompt is computed and
    brings the cache hit, the prompt's writes (and the miss's cause), so its usage is already exact; when asked,
    both usages carry cache_miss, as the plain answer's does (the SDK's final message keeps message_start's)."""
    started = False
    blocks = _Blocks()
    reader = CallStream(tool_use_id) if reads_calls else None
    output_tokens = 0
    cached, writes = 0, CacheWrites()
    miss: CacheMiss | None = None
    final: RequestOutput | None = None
    async for _, output in group:
        cached, writes = output.num_cached_tokens, output.cache_writes
        miss = output.cache_miss or miss
        completion = output.outputs[0] if output.outputs else None
        if not started:
            started = True
            message: dict = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": accounting.usage(cached, writes, 0, miss),
            }
            yield sse({"type": "message_start", "message": message}, event="message_start")
        if completion is None:
            continue
        output_tokens += len(completion.token_ids)
        if output.finished:
            final = output
        if reader is None:
            events = [StreamEvent("text", text=completion.text)] if completion.text else []
        else:
            events = reader.feed(completion.text) + (reader.finish() if output.finished else [])
        for event in events:
            for chunk in blocks.write(event):
                yield chunk
    for chunk in blocks.close():
        yield chunk
    called = reader is not None and reader.calls > 0
    stop_reason, stop_sequence = _stop(final, called) if final is not None and final.outputs else ("max_tokens", None)
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": accounting.usage(cached, writes, output_tokens, miss),
    }
    yield sse(delta, event="message_delta")
    yield sse({"type": "message_stop"}, event="message_stop")


class _Blocks:
    """The open content block of a streamed message: text goes into a text block, each call into a tool_use
    block of its own, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or "tool_use"

    def write(self, event: StreamEvent) -> list[str]:
        out = []
        wanted = "text" if event.kind == "text" else "tool_use"
        if event.kind == "call" or self.open != wanted:
            out += self.close()
            self.index += 1
            self.open = wanted
            block = (
                {"type": "text", "text": ""}
                if wanted == "text"
                else {"type": "tool_use", "id": event.call_id, "name": event.text, "input": {}}
            )
            start = {"type": "content_block_start", "index": self.index, "content_block": block}
            out.append(sse(start, event="content_block_start"))
        if event.kind == "call":
            return out
        delta = (
            {"type": "text_delta", "text": event.text}
            if wanted == "text"
            else {"type": "input_json_delta", "partial_json": event.text}
        )
        out.append(
            sse({"type": "content_block_delta", "index": self.index, "delta": delta}, event="content_block_delta")
        )
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, event="content_block_stop")]
