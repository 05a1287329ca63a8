"""Google's Gemini API (v1beta) over the same engine, so the unmodified google-genai SDK works against this server:
models/{model}:generateContent, :streamGenerateContent (?alt=sse), :countTokens, cachedContents, and the model's
Model resource (GET models, models/{model}).

The model methods are also served under v1, the SDK's default api_version, with the same bodies (v1beta's, a
superset of v1's). Only they: Gemini's v1 has no cachedContents, and its GET v1/models would be OpenAI's model list
(admin.py), which owns that path here; list or get the model under v1beta.

Contents become chat messages (gemini_protocol.py) and go through the model's chat template as a
/v1/chat/completions request's would, so the same conversation hits the same cached pages on either API.
`usageMetadata.cachedContentTokenCount` is what the prefix cache served (the engine's num_cached_tokens), with or
without a cachedContent: on Gemini, implicit caching reports its hits in the same field. With responseLogprobs, a
candidate carries logprobsResult (each generated token, a function call's too; `logprobs` alternatives each) and
avgLogprobs; streamed, each chunk those of the tokens since the last chunk, and the last chunk avgLogprobs.

cachedContents are the /v1/caches entries (caches.py, cache_store.py) under Gemini's names and fields: one store,
so an entry made here is usable as `cached_content` on the other APIs and the other way round. A request naming one
is served on top of it (cached_content.py). Errors under /v1beta and on the v1 model methods are Gemini's
{"error": {"code", "message", "status"}} (errors.py), and keys may come as `x-goog-api-key`, how the SDK sends
them (auth.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from prefixkv.batch import Sample
from prefixkv.outputs import RequestOutput
from prefixkv.request_options import NO_RETENTION
from prefixkv.server.auth import cache_salt_for, principal_of
from prefixkv.server.cache_store import GEMINI_NAME_PREFIX, ID_PREFIX, PAGE_TOKENS_HEADER, CacheEntry, rfc3339
from prefixkv.server.cached_content import entry_for, owner_of, use_retention
from prefixkv.server.caches import (
    DEFAULT_PAGE_SIZE,
    DEFAULT_TTL_SECONDS,
    MAX_PAGE_SIZE,
    add_entry,
    change_expiry,
    check_caching,
    check_room,
    expiry,
    remove_entry,
    visible_entry,
)
from prefixkv.server.errors import APIError
from prefixkv.server.gemini_protocol import (
    MODEL_PREFIX,
    CountTokensRequest,
    CreateCachedContentRequest,
    GenerateContentRequest,
    UpdateCachedContentRequest,
    model_name,
)
from prefixkv.server.logprobs import gemini_logprobs
from prefixkv.server.request_options import request_options
from prefixkv.server.sse import answer, sse
from prefixkv.server.state import ServerState, server_state, submit
from prefixkv.tools.parse import CallStream, split_answer
from prefixkv.tools.spec import ToolCall

router = APIRouter()

_FINISH = {"stop": "STOP", "length": "MAX_TOKENS"}
_UPDATABLE = {"ttl": "ttl", "expireTime": "expire_time", "expire_time": "expire_time"}


@router.get("/v1beta/models")
async def list_models(
    raw: Request,
    page_size: Annotated[int, Query(alias="pageSize", ge=0, description="any size holds the one model")] = 0,
    page_token: Annotated[str | None, Query(alias="pageToken", max_length=32)] = None,
) -> dict:
    """The served model, on one page: no nextPageToken is given out, so none can come back."""
    if page_token:
        raise APIError("pageToken is not one this server gave out", param="page_token")
    return {"models": [_model(server_state(raw))]}


@router.get("/v1beta/models/{model}")
async def get_model(model: str, raw: Request) -> dict:
    state = server_state(raw)
    _check_model(state, model, raw)
    return _model(state)


@router.post("/v1beta/models/{model}:generateContent")
@router.post("/v1/models/{model}:generateContent")
async def generate_content(model: str, body: GenerateContentRequest, raw: Request):
    return await _generate(model, body, raw, stream=False)


@router.post("/v1beta/models/{model}:streamGenerateContent")
@router.post("/v1/models/{model}:streamGenerateContent")
async def stream_generate_content(
    model: str,
    body: GenerateContentRequest,
    raw: Request,
    alt: Annotated[str | None, Query(max_length=16, description="'sse': the only stream format served")] = None,
):
    """Streamed as server-sent events, each `data:` a GenerateContentResponse with the new text; the last one
    carries finishReason and usageMetadata. Gemini's other format (a JSON array, without ?alt=sse) is not served."""
    if alt != "sse":
        raise APIError("streamGenerateContent is served as server-sent events only: add ?alt=sse", param="alt")
    return await _generate(model, body, raw, stream=True)


@router.post("/v1beta/models/{model}:countTokens")
@router.post("/v1/models/{model}:countTokens")
async def count_tokens(model: str, body: CountTokensRequest, raw: Request) -> dict:
    """totalTokens: the prompt generateContent would compute (promptTokenCount), a cachedContent's included."""
    state = server_state(raw)
    _check_model(state, model, raw)
    request = body.request()
    messages = request.messages()
    entry = _entry(state, raw, request, messages)
    prompt = await state.tokenize_chat([*entry.messages, *messages] if entry else messages)
    out = {"totalTokens": len(prompt)}
    if entry is not None:
        out["cachedContentTokenCount"] = len(entry.token_ids)
    return out


async def _generate(model: str, body: GenerateContentRequest, raw: Request, stream: bool):
    state = server_state(raw)
    served = _check_model(state, model, raw)
    messages = body.messages()
    params = body.sampling_params()
    entry = _entry(state, raw, body, messages)
    if entry is not None:  # served on top of the entry: its messages, then the request's
        messages = [*entry.messages, *messages]
    prompt = await state.tokenize_chat(messages)
    response_id = uuid.uuid4().hex
    options = request_options(state, raw, params, retention=use_retention(entry, NO_RETENTION, prompt), api="gemini")
    group = await submit(state, f"gemini-{response_id}", [prompt], options, stream)
    meta = {"modelVersion": served, "responseId": response_id}
    calls = body.reads_calls
    logprobs = _Logprobs(state, params.logprobs)
    if stream:
        events = _stream(group, len(prompt), meta, calls, logprobs)
        return await answer(raw, group, events, error_event=_error_event, done=None)
    return await answer(raw, group, None, lambda finals: _response(finals[0], meta, calls, logprobs))


def _check_model(state: ServerState, model: str, raw: Request) -> str:
    """Gemini's 404 for another model (the URL's {model} may be NAME or models/NAME), naming the path's version."""
    try:
        return state.check_model(model_name(model))
    except APIError:
        version = raw.url.path.split("/", 2)[1]
        raise APIError(
            f"models/{model_name(model)} is not found for API version {version}; this server serves "
            f"{MODEL_PREFIX}{state.served_model_name}",
            status=404,
            param="model",
        ) from None


def _model(state: ServerState) -> dict:
    """The served model as Gemini's Model resource: its limits are this server's context (a prompt leaves one
    token to generate), its sampling defaults and bounds those generateContent applies (gemini_protocol.py)."""
    name = state.served_model_name
    methods = ["generateContent", "countTokens"] + (["createCachedContent"] if state.prefix_caching else [])
    return {
        "name": MODEL_PREFIX + name,
        "displayName": name,
        "description": f"{name}, served by prefixkv",
        "inputTokenLimit": state.max_model_len - 1,
        "outputTokenLimit": state.max_model_len - 1,
        "supportedGenerationMethods": methods,
        "temperature": 1.0,
        "maxTemperature": 2.0,
        "topP": 1.0,
    }


def _entry(state: ServerState, raw: Request, body: GenerateContentRequest, messages: list) -> CacheEntry | None:
    """The request's cachedContent (None without one); Gemini's 400 when it also sets a systemInstruction."""
    if body.cached_content is None:
        return None
    if body.system_instruction is not None:
        raise APIError(
            "CachedContent can not be used with a GenerateContent request setting systemInstruction: "
            "put it in the cached content",
            param="cached_content",
        )
    return entry_for(state, raw, body.cached_content, "messages", None, None)


def _candidate(text: str, finish: str | None = None, calls: Sequence[ToolCall] = ()) -> dict:
    """A candidate's text part (unless the answer is calls alone), then a functionCall part per call."""
    parts: list[dict] = [{"text": text}] if text or not calls else []
    parts += [{"functionCall": {"name": c.name, "args": json.loads(c.arguments)}} for c in calls]
    candidate: dict = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    return candidate


class _Logprobs:
    """A request's logprobsResult writer: adds it (and avgLogprobs over `every` token) to a candidate when the
    request asked (top: the alternatives per token, None: not asked)."""

    def __init__(self, state: ServerState, top: int | None) -> None:
        self.tokenizer, self.top = state.tokenizer, top

    def add(self, candidate: dict, entries: list[Sample], every: list[Sample] | None = None) -> dict:
        if self.top is None:
            return candidate
        candidate["logprobsResult"] = gemini_logprobs(self.tokenizer, entries, self.top)
        if every is not None:
            finite = [e.logprob for e in every if e.logprob is not None]
            candidate["avgLogprobs"] = sum(finite) / len(finite) if finite else 0.0
        return candidate


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {
        "promptTokenCount": prompt_tokens,
        "candidatesTokenCount": output_tokens,
        "totalTokenCount": prompt_tokens + output_tokens,
        "cachedContentTokenCount": max(0, cached),
    }


def _response(final: RequestOutput, meta: dict, reads_calls: bool, logprobs: _Logprobs) -> dict:
    completion = final.outputs[0]
    text, calls = split_answer(completion.text, _no_id) if reads_calls else (completion.text, [])
    candidate = _candidate(text, _FINISH.get(completion.finish_reason or "", "STOP"), calls)
    entries = list(completion.logprobs or [])
    return {
        "candidates": [logprobs.add(candidate, entries, entries)],
        "usageMetadata": _usage(len(final.prompt_token_ids), final.num_cached_tokens, len(completion.token_ids)),
        **meta,
    }


def _error_event(err: APIError) -> str:
    return sse(err.gemini_body())


def _no_id() -> str:
    return ""  # Gemini's functionCall parts carry no id here (a call is matched to its response by name)


async def _stream(group, prompt_tokens: int, meta: dict, reads_calls: bool, logprobs: _Logprobs) -> AsyncIterator[str]:
    """One chunk per output with new text; the final one with finishReason and usageMetadata, text or not. A
    function call comes whole (as Gemini streams them), in the final chunk."""
    output_tokens = 0
    reader = CallStream(_no_id) if reads_calls else None
    calls: list[ToolCall] = []
    every: list[Sample] = []
    pending: list[Sample] = []  # tokens no chunk has carried the logprobs of yet
    async for _, output in group:
        completion = output.outputs[0] if output.outputs else None
        if completion is None:
            continue
        output_tokens += len(completion.token_ids)
        every.extend(completion.logprobs or [])
        pending.extend(completion.logprobs or [])
        text = completion.text
        if reader is not None:
            text = ""
            for e in reader.feed(completion.text) + (reader.finish() if output.finished else []):
                if e.kind == "text":
                    text += e.text
                elif e.kind == "call":
                    calls.append(ToolCall("", e.text, ""))
                else:
                    calls[-1] = ToolCall("", calls[-1].name, calls[-1].arguments + e.text)
        if output.finished:
            calls = calls[: reader.complete] if reader is not None else calls  # a call cut short is dropped
            finish = _FINISH.get(completion.finish_reason or "", "STOP")
            usage = _usage(prompt_tokens, output.num_cached_tokens, output_tokens)
            candidate = logprobs.add(_candidate(text, finish, calls), pending, every)
            yield sse({"candidates": [candidate], "usageMetadata": usage, **meta})
        elif text:
            yield sse({"candidates": [logprobs.add(_candidate(text), pending)], **meta})
            pending = []


# -- cachedContents -----------------------------------------------------------------------------------------


@router.post("/v1beta/cachedContents")
async def create_cached_content(body: CreateCachedContentRequest, raw: Request) -> dict:
    """A messages entry (systemInstruction first, then contents), computed now and retained until its expiry."""
    state = server_state(raw)
    model = _check_model(state, body.model, raw)
    check_caching(state)
    messages = body.messages()
    now = time.time()
    expire_time = expiry(body.ttl, body.expire_time, now, default=DEFAULT_TTL_SECONDS, expire_field="expireTime")
    owner = owner_of(state, raw, None)
    check_room(state, owner)
    token_ids = await state.tokenize_chat(messages, add_generation_prompt=False)
    entry = CacheEntry(
        id=ID_PREFIX + uuid.uuid4().hex,
        owner=owner,
        cache_salt=cache_salt_for(state.tenant_isolation, raw, None, None),
        kind="messages",
        token_ids=tuple(token_ids),
        messages=tuple(messages),
        model=model,
        display_name=body.display_name,
        create_time=now,
        update_time=now,
        expire_time=expire_time,
    )
    await add_entry(state, entry, param="contents")
    return _resource(entry)


@router.get("/v1beta/cachedContents")
async def list_cached_contents(
    raw: Request,
    response: Response,
    page_size: Annotated[int, Query(alias="pageSize", ge=0, description="0: the default (100); at most 1000")] = 0,
    page_token: Annotated[str | None, Query(alias="pageToken", max_length=32)] = None,
) -> dict:
    """Newest first; nextPageToken (absent on the last page) asks for the entries after this page (and the
    PAGE_TOKENS_HEADER header gives each row's)."""
    state = server_state(raw)
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    before = None
    if page_token:
        if not page_token.isdigit() or int(page_token) < 1:
            raise APIError("pageToken is not one this server gave out", param="page_token")
        before = int(page_token)
    rows = state.caches.listing(owner_of(state, raw, None), principal_of(raw).is_admin, before)
    rows = [e for e in rows if e.kind == "messages"]  # a /v1/caches prompt entry is no Gemini content
    out: dict = {"cachedContents": [_resource(e) for e in rows[:size]]}
    response.headers[PAGE_TOKENS_HEADER] = ",".join(str(e.seq) for e in rows[:size])
    if len(rows) > size:
        out["nextPageToken"] = str(rows[size - 1].seq)
    return out


@router.get("/v1beta/cachedContents/{cache_id}")
async def get_cached_content(cache_id: str, raw: Request) -> dict:
    return _resource(_visible(server_state(raw), raw, cache_id))


@router.patch("/v1beta/cachedContents/{cache_id}")
async def update_cached_content(
    cache_id: str,
    body: UpdateCachedContentRequest,
    raw: Request,
    update_mask: Annotated[str | None, Query(alias="updateMask", max_length=256)] = None,
) -> dict:
    """Only the expiry changes (ttl or expireTime, as Gemini allows); updateMask, when sent, must name it."""
    state = server_state(raw)
    entry = _visible(state, raw, cache_id)
    ttl, expire_time = body.ttl, body.expire_time
    if update_mask:
        fields = {f.strip() for f in update_mask.split(",")}
        if not fields <= set(_UPDATABLE):
            raise APIError(f"only ttl or expireTime can be updated, got updateMask {update_mask!r}", param="updateMask")
        named = {_UPDATABLE[f] for f in fields}
        ttl = ttl if "ttl" in named else None
        expire_time = expire_time if "expire_time" in named else None
    if (ttl is None) == (expire_time is None):
        raise APIError("give exactly one of 'ttl' and 'expireTime'", param="ttl")
    if not await change_expiry(state, entry, expiry(ttl, expire_time, time.time(), expire_field="expireTime")):
        raise _not_found(cache_id)
    return _resource(entry)


@router.delete("/v1beta/cachedContents/{cache_id}")
async def delete_cached_content(cache_id: str, raw: Request) -> dict:
    """Gone at once, its retention released (caches.py); Gemini answers an empty object."""
    state = server_state(raw)
    if not await remove_entry(state, _visible(state, raw, cache_id)):
        raise _not_found(cache_id)
    return {}


def _visible(state: ServerState, raw: Request, cache_id: str) -> CacheEntry:
    entry = visible_entry(state, raw, cache_id)
    if entry is None or entry.kind != "messages":  # a /v1/caches prompt entry is no Gemini content
        raise _not_found(cache_id)
    return entry


def _not_found(cache_id: str) -> APIError:
    return APIError(f"CachedContent not found: {GEMINI_NAME_PREFIX}{cache_id}", status=404, param="name")


def _resource(entry: CacheEntry) -> dict:
    """The CachedContent as Gemini answers it (no contents: Gemini never sends them back)."""
    out = {
        "name": GEMINI_NAME_PREFIX + entry.id,
        "model": MODEL_PREFIX + entry.model,
        "createTime": rfc3339(entry.create_time),
        "updateTime": rfc3339(entry.update_time),
        "expireTime": rfc3339(entry.expire_time),
        "usageMetadata": {"totalTokenCount": len(entry.token_ids)},
    }
    if entry.display_name is not None:
        out["displayName"] = entry.display_name
    return out
