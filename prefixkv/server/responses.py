"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): OpenAI's Responses API over the same engine.

The request's messages go through the chat template like /v1/chat/completions. `store` (default true, as
OpenAI's) keeps the response with its whole conversation (response_store.py), and `previous_response_id`
continues from one: the prompt is the stored turns, then the new input, behind this request's `instructions`
(which, as OpenAI's, are not carried over). Sent with the same instructions, each turn's prompt starts with the
previous turn's, which the prefix cache holds, so `usage.input_tokens_details.cached_tokens` covers the session
so far, and `cache_write_tokens` what this request wrote into it (the engine's count, server/usage.py).
`prompt_cache_key` and `prompt_cache_retention` mean what they mean on chat completions (server.md).
Asked for (`include`), the message's output_text carries every generated token's logprobs, in order (a function
call's tokens too: an answer that is calls alone has no message, so no logprobs), and each streamed text delta
those of the tokens that came since the last one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from prefixkv.batch import Sample
from prefixkv.outputs import RequestOutput
from prefixkv.server.auth import principal_of, request_api_key, tenant_owner
from prefixkv.server.cached_content import entry_for, use_retention
from prefixkv.server.errors import APIError
from prefixkv.server.logprobs import chat_logprobs
from prefixkv.server.request_options import body_options
from prefixkv.server.response_store import StoredResponse
from prefixkv.server.responses_protocol import ResponsesRequest
from prefixkv.server.sse import answer, sse
from prefixkv.server.state import ServerState, server_state, submit
from prefixkv.tools.parse import CallStream, StreamEvent, split_answer
from prefixkv.tools.prompt import render_messages
from prefixkv.tools.spec import ToolCall

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request):
    state = server_state(raw)
    model = state.check_model(body.model)
    owner = _owner(state, raw, body.user)
    history: tuple[dict[str, Any], ...] = ()
    if body.previous_response_id is not None:
        previous = state.responses.get(owner, body.previous_response_id)
        if previous is None:
            raise APIError(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = previous.messages
    turn = [*history, *body.input_messages()]
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    entry = entry_for(state, raw, body.cached_content, "messages", body.user, body.cache_salt)
    tools = body.tool_spec[0]
    if entry is not None and tools:
        raise APIError("tools cannot be combined with cached_content", param="tools", code="unsupported")
    cached = list(entry.messages) if entry is not None else []  # a /v1/caches entry's messages come first
    try:
        messages = render_messages(cached + instructions + turn, tools)
    except ValueError as exc:
        raise APIError(f"input: {exc}", param="input", code="invalid_value") from None
    prompt = await state.tokenize_chat(messages)
    response_id = f"resp_{uuid.uuid4().hex}"
    options = body_options(
        state, raw, body, body.sampling_params(), use_retention(entry, body.retention(), prompt), api="responses"
    )
    group = await submit(state, response_id, [prompt], options, body.stream)
    made = _Made(state, owner, body, response_id, model, turn)
    if body.stream:
        return await answer(raw, group, _stream(group, made), error_event=_error_event, done=None)
    return await answer(raw, group, None, lambda finals: made.finish(finals[0]))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, raw: Request):
    state = server_state(raw)
    stored = state.responses.get(_owner(state, raw, None), response_id)
    if stored is None:
        raise APIError(f"Response with id '{response_id}' not found.", status=404, param="response_id")
    return stored.body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request):
    state = server_state(raw)
    if not state.responses.delete(_owner(state, raw, None), response_id):
        raise APIError(f"Response with id '{response_id}' not found.", status=404, param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}


def _owner(state: ServerState, raw: Request, user: str | None) -> str | None:
    """Whose stored responses these are: the tenant, as tenant isolation names it (None: isolation off)."""
    return tenant_owner(state.tenant_isolation, principal_of(raw), request_api_key(raw), user)


class _Made:
    """One response being made: its fixed fields, and storing it once it is done."""

    def __init__(
        self, state: ServerState, owner: str | None, body: ResponsesRequest, response_id: str, model: str, turn
    ) -> None:
        self.state, self.owner, self.body, self.id, self.model, self.turn = state, owner, body, response_id, model, turn
        self.created = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"

    def item(self, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
        content = []
        if status == "completed":
            part: dict = {"type": "output_text", "text": text, "annotations": []}
            if self.body.logprobs is not None:
                part["logprobs"] = logprobs or []
            content.append(part)
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def logprobs(self, entries: list[Sample]) -> list[dict]:
        """output_text.logprobs for these tokens (empty when the request asked none)."""
        return chat_logprobs(self.state.tokenizer, entries)["content"] if self.body.logprobs is not None else []

    def output(self, text: str, calls: list[ToolCall], logprobs: list[dict]) -> list[dict]:
        """The output items: the message (unless the answer is calls alone), then a function_call per call."""
        items = [self.item(text, "completed", logprobs)] if text or not calls else []
        return items + [call_item(c, "completed") for c in calls]

    def response(self, status: str, output: list[dict], usage: dict | None, incomplete: bool = False) -> dict:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "previous_response_id": b.previous_response_id,
            "prompt_cache_key": b.prompt_cache_key,
            "prompt_cache_retention": b.prompt_cache_retention,
            "store": b.store,
            "metadata": b.metadata or {},
            "user": b.user,
            "output": output,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "tool_choice": b.tool_choice or ("auto" if b.tools else "none"),
            "tools": b.tools or [],
            "text": {"format": {"type": "text"}},
            "top_logprobs": b.top_logprobs,
            "truncation": "disabled",
            "usage": usage,
        }

    def finish(
        self,
        final: RequestOutput,
        text: str | None = None,
        output_tokens: int | None = None,
        calls: list[ToolCall] | None = None,
        logprobs: list[dict] | None = None,
    ) -> dict:
        """The finished response (stored when asked). text / output_tokens / calls / logprobs: a stream's, which
        kept no final."""
        completion = final.outputs[0]
        if text is None:
            text, calls = split_answer(completion.text, call_id) if self.body.reads_calls else (completion.text, [])
            logprobs = self.logprobs(list(completion.logprobs or []))
        calls = calls or []
        output_tokens = len(completion.token_ids) if output_tokens is None else output_tokens
        prompt_tokens = len(final.prompt_token_ids)
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": _input_details(self.body, final),
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }
        incomplete = completion.finish_reason == "length"
        output = self.output(text, calls, logprobs or [])
        body = self.response("incomplete" if incomplete else "completed", output, usage, incomplete)
        if self.body.store:
            messages = (*self.turn, {"role": "assistant", "content": text, "tool_calls": calls})
            self.state.responses.put(self.owner, self.id, StoredResponse(body, messages))
        return body


def _input_details(body: ResponsesRequest, final: RequestOutput) -> dict:
    # cache_write_tokens: what the engine counted this request inserting into the prefix cache (server/usage.py)
    details: dict = {"cached_tokens": max(0, final.num_cached_tokens), "cache_write_tokens": final.num_written_tokens}
    if body.explain_cache_miss and final.cache_miss is not None:  # prefixkv's extension, as on chat completions
        details["cache_miss"] = final.cache_miss.to_json()
    return details


def _error_event(err: APIError) -> str:
    return sse({"type": "error", "code": err.code, "message": err.message, "param": err.param}, event="error")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_item(call: ToolCall, status: str) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


async def _stream(group, made: _Made) -> AsyncIterator[str]:
    """OpenAI's event sequence: response.created, .in_progress; the message item (output_item.added,
    content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done), opened at
    the first text (or at the end, empty, when the answer has neither text nor calls); a function_call item per
    call (output_item.added, function_call_arguments.delta..., .done, output_item.done); response.completed."""
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, event=kind)

    yield event("response.created", response=made.response("in_progress", [], None))
    yield event("response.in_progress", response=made.response("in_progress", [], None))
    part = {"type": "output_text", "text": "", "annotations": []}
    reader = CallStream(call_id) if made.body.reads_calls else None
    text, output_tokens, final = "", 0, None
    calls: list[ToolCall] = []
    pending: list[Sample] = []  # tokens whose logprobs no text delta has carried yet
    message_logprobs: list[dict] = []
    index = -1  # the open item's output_index
    open_kind: str | None = None  # "message" or "function_call"

    def close() -> list[str]:
        nonlocal open_kind
        out = []
        if open_kind == "message":
            where = {"item_id": made.item_id, "output_index": index, "content_index": 0}
            message_logprobs.extend(made.logprobs(pending))  # the tokens after the last delta (a call's)
            pending.clear()
            out.append(event("response.output_text.done", **where, text=text, logprobs=message_logprobs))
            item = made.item(text, "completed", message_logprobs)
            out.append(event("response.content_part.done", **where, part=item["content"][0]))
            out.append(event("response.output_item.done", output_index=index, item=item))
        elif open_kind == "function_call":
            item = call_item(calls[-1], "completed")
            done = {"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]}
            out.append(event("response.function_call_arguments.done", **done))
            out.append(event("response.output_item.done", output_index=index, item=item))
        open_kind = None
        return out

    def write(e: StreamEvent) -> list[str]:
        nonlocal index, open_kind, text
        out = []
        if e.kind == "text":
            if open_kind != "message":
                out += close()
                index, open_kind = index + 1, "message"
                out.append(event("response.output_item.added", output_index=index, item=made.item("", "in_progress")))
                where = {"item_id": made.item_id, "output_index": index, "content_index": 0}
                out.append(event("response.content_part.added", **where, part=part))
            text += e.text
            where = {"item_id": made.item_id, "output_index": index, "content_index": 0}
            if e.text:
                logprobs = made.logprobs(pending)
                pending.clear()
                message_logprobs.extend(logprobs)
                out.append(event("response.output_text.delta", **where, delta=e.text, logprobs=logprobs))
        elif e.kind == "call":
            out += close()
            index, open_kind = index + 1, "function_call"
            calls.append(ToolCall(e.call_id, e.text, ""))
            out.append(
                event("response.output_item.added", output_index=index, item=call_item(calls[-1], "in_progress"))
            )
        else:
            call = calls[-1]
            calls[-1] = ToolCall(call.id, call.name, call.arguments + e.text)
            item_id = "fc_" + call.id.removeprefix("call_")
            out.append(
                event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=e.text)
            )
        return out

    async for _, output in group:
        if not output.outputs:
            continue
        completion = output.outputs[0]
        output_tokens += len(completion.token_ids)
        pending.extend(completion.logprobs or [])
        if reader is None:
            events = [StreamEvent("text", text=completion.text)] if completion.text else []
        else:
            events = reader.feed(completion.text) + (reader.finish() if output.finished else [])
        for e in events:
            for chunk in write(e):
                yield chunk
        if output.finished:
            final = output
    if final is None:
        return
    if index < 0:  # neither text nor calls: the empty message
        for chunk in write(StreamEvent("text", text="")):
            yield chunk
    for chunk in close():
        yield chunk
    done = made.finish(final, text, output_tokens, calls, message_logprobs)
    yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
