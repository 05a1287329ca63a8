"""What every handler needs, hung on app.state.server: the engine loop, names, metrics and policies; and
the step between a handler and the engine: prompt text becomes token ids here, in a worker thread.

Why a worker thread: tokenizing (and chat templating) a long text takes time proportional to its length.
On the engine thread it stalls every running stream; on the event loop it stalls every connection. Text far
longer than any prompt that could fit the context is refused before it is tokenized at all (max_prompt_chars).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
from fastapi import Request

from prefixkv.engine.client import EngineTokenizer
from prefixkv.engine.prompts import shared_prefix
from prefixkv.request_options import RequestOptions
from prefixkv.server.async_engine import AsyncEngine, RequestGroup
from prefixkv.server.auth import KeyRing
from prefixkv.server.cache_store import CacheStore
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.messages_protocol import Conversation
from prefixkv.server.metrics import ServerMetrics
from prefixkv.server.protocol import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST
from prefixkv.server.response_store import ResponseStore

logger = logging.getLogger(__name__)

# A normalizer may turn one character of input into more than one (NFKC "ﬁ" -> "fi"): leave that much slack.
_CHARS_SLACK = 2


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: EngineTokenizer
    served_model_name: str
    max_model_len: int
    page_size: int  # tokens per KV page (the router's /load reports it)
    metrics: ServerMetrics
    keys: KeyRing | None = None  # None: no key configured, every caller is an admin
    tenant_isolation: str = "none"
    max_n: int = DEFAULT_MAX_N  # completions per prompt
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # prompts in one /v1/completions request
    allow_special_tokens_in_content: bool = False  # chat content may contain control tokens (unsafe)
    clamp_max_tokens: frozenset[str] = frozenset()  # APIs whose max_tokens is lowered to what fits (options.py)
    max_prompt_chars: int = 0  # longer prompt text cannot fit max_model_len tokens: refused untokenized
    prefix_caching: bool = True  # False with prefix_cache "off": nothing is read from or written to a cache
    responses: ResponseStore = field(default_factory=ResponseStore)  # what /v1/responses stored
    caches: CacheStore = field(default_factory=CacheStore)  # the entries of /v1/caches
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixkv-tokenizer"
        )
    )

    def __post_init__(self) -> None:
        if not self.max_prompt_chars:
            self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars() * _CHARS_SLACK

    def check_prompt_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(
                f"{param} is {chars} characters long; no text over {self.max_prompt_chars} characters "
                f"can fit the model's context of {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt_tokens(self, n: int, param: str) -> None:
        """The engine's own first length check, made here so a long prompt's ids never reach its thread."""
        if n >= self.max_model_len:
            raise APIError(
                f"the prompt has {n} tokens but the model's context length (max_model_len) is "
                f"{self.max_model_len}; at least one token must be left to generate",
                param=param,
                code="context_length_exceeded",
            )

    async def tokenize(self, prompts: list[str | list[int] | dict]) -> list[dict | list[int]]:
        """Engine prompts: text becomes {prompt, prompt_token_ids}; token ids and engine prompts pass as given."""
        for p in prompts:
            if isinstance(p, str):
                self.check_prompt_chars(len(p), "prompt")
        out: list[dict | list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                ids = await self._in_worker(self.tokenizer.encode, p)
                self.check_prompt_tokens(len(ids), "prompt")
                out.append({"prompt": p, "prompt_token_ids": ids})
            else:
                out.append(p)
        return out

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One text's token ids, in the tokenizer worker; refused as a prompt is when it cannot fit the context."""
        self.check_prompt_chars(len(text), "prompt")
        ids = await self._in_worker(_encode, self.tokenizer, text, add_special_tokens)
        self.check_prompt_tokens(len(ids), "prompt")
        return ids

    async def tokenize_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The engine prompt for chat messages (already checked by ChatCompletionRequest.template_messages);
        without the generation prompt: a conversation's prefix, as a /v1/caches entry holds it."""
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        prompt = await self._in_worker(
            _chat_prompt, self.tokenizer, messages, self.allow_special_tokens_in_content, add_generation_prompt
        )
        self.check_prompt_tokens(len(prompt), "messages")
        return prompt

    async def tokenize_conversation(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        """A Messages API conversation's prompt ids, and where its cache breakpoints fall in them (in tokens)."""
        self.check_prompt_chars(sum(len(m["content"]) for m in conversation.messages), "messages")
        prompt, positions = await self._in_worker(
            _conversation_prompt, self.tokenizer, conversation, self.allow_special_tokens_in_content
        )
        self.check_prompt_tokens(len(prompt), "messages")
        return prompt, positions

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def begin_shutdown(self, timeout: float) -> None:
        """Called as the server stops accepting: requests still running after `timeout` seconds are cut."""
        logger.info("shutting down: in-flight requests have %gs to finish (--shutdown-timeout)", timeout)
        asyncio.get_running_loop().call_later(timeout, self._cut_in_flight, timeout)

    def _cut_in_flight(self, timeout: float) -> None:
        error = APIError(
            f"The server is shutting down; the request was cut after {timeout:g}s", status=503, code="server_shutdown"
        )
        cut = self.engine.cut_all(error)
        if cut:
            logger.warning("cut %d request(s) still running %gs after shutdown began", cut, timeout)

    def check_model(self, model: str | None) -> str:
        """OpenAI answers an unknown model with 404; an omitted model means the one being served."""
        if model is not None and model != self.served_model_name:
            raise APIError(
                f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                status=404,
                param="model",
                code="model_not_found",
            )
        return self.served_model_name


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def _encode(tokenizer: EngineTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens)


def _chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, str]],
    allow_special_tokens_in_content: bool,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Chat messages -> the engine prompt's token ids (the engine needs no text). Runs in the tokenizer
    worker thread; special-token text in message content stays text unless the server allows it."""
    try:
        ids = tokenizer.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            allow_special_tokens_in_content=allow_special_tokens_in_content,
        )
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise APIError(
            f"messages could not be rendered by the chat template: {exc}", param="messages", code="invalid_value"
        ) from None
    return ids


def _conversation_prompt(
    tokenizer: Any, conversation: Conversation, allow_special: bool
) -> tuple[list[int], list[int]]:
    """The prompt's token ids and, per breakpoint, how many of its leading tokens the conversation up to the
    breakpoint shares with it (the cut rendered without a generation prompt: the template closes the cut message,
    so the shared run ends where the block's text does)."""
    prompt = _chat_prompt(tokenizer, conversation.messages, allow_special)
    positions = []
    for bp in conversation.breakpoints:
        cut = _chat_prompt(tokenizer, conversation.cut(bp), allow_special, add_generation_prompt=False)
        positions.append(shared_prefix(cut, prompt))
    return prompt, positions


async def submit(
    state: ServerState, request_id: str, prompts: list, options: RequestOptions, stream: bool
) -> RequestGroup:
    """Add one engine request per prompt with the route's options (server/request_options.py); engine
    rejections (too long, bad ids, ...) become 400s. Text prompts are tokenized here, off the engine thread; chat
    handlers pass state.tokenize_chat's result. A router routes on the first prompt: its held-elsewhere hint says
    nothing of the others."""
    prompts = await state.tokenize(prompts)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    record_prompt_cache_key(state, request_id, options.prompt_cache_key)
    rest = replace(options, held_elsewhere_tokens=0) if options.held_elsewhere_tokens else options
    try:
        return await state.engine.submit(ids, prompts, [options] + [rest] * (len(prompts) - 1), stream=stream)
    except ValueError as exc:
        raise from_value_error(exc) from None


def record_prompt_cache_key(state: ServerState, request_id: str, key: str | None) -> None:
    """prompt_cache_key is a grouping hint: logged with the request id and counted (no per-key metric label:
    keys are unbounded). Routers read it from the body themselves (serve_ray/ingress.py)."""
    if key is not None:
        state.metrics.prompt_cache_keyed.inc()
        logger.debug("request %s prompt_cache_key=%r", request_id, key)
