"""Request bodies of the OpenAI API (the fields prefixkv honours), plus vLLM's extensions.

Every field is honoured, accepted with no effect, or refused with a 400 naming it (request_fields.py); an
unknown field is a 400 as OpenAI answers one. Types are strict where OpenAI's are
("2" is not an integer, "yes" is not a boolean; an integer is a valid float), and floats must be finite
(Python's JSON parser accepts NaN and Infinity). The ranges are declared on the fields, so /openapi.json tells
a client what is accepted; SamplingParams checks them again for the Python API. Each bad field gets a 400 that
names it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefixkv.kvcache.retention import PROMPT_CACHE_RETENTION
from prefixkv.request_options import Retention
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.openai_tools import read_calls, read_tools
from prefixkv.server.request_fields import CHAT, COMPLETIONS, TableFields
from prefixkv.server.structured import from_openai
from prefixkv.structured_outputs import StructuredOutputs
from prefixkv.tools.grammar import tool_constraint
from prefixkv.tools.prompt import render_messages
from prefixkv.tools.spec import Tool, ToolChoice

# OpenAI's limits where it has them; the server's own caps (n, prompts per request) are options, so the
# published schema gets them from the running server (see openapi.py).
MAX_LOGPROBS = 20
DEFAULT_MAX_N = 128  # OpenAI's cap on n; the server's --max-n
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024  # the server's --max-prompts-per-request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's, also when a client sends max_tokens: null
MAX_PROMPT_CACHE_KEY_CHARS = 1024
MAX_CACHED_CONTENT_CHARS = 256  # a /v1/caches entry's name
CACHED_CONTENT = "a /v1/caches entry (id or name) to serve the request on top of (as Gemini's cachedContent)"
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class PromptCacheFields(TableFields):
    """OpenAI's prompt-cache fields, on every request that fills the cache."""

    model_config = _STRICT

    prompt_cache_key: str | None = Field(
        None,
        max_length=MAX_PROMPT_CACHE_KEY_CHARS,
        description="groups requests that share a prefix (a routing hint: replicas route a key to one engine)",
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="24h: keep this request's prompt KV cached for a day (bounded by the server's cap)"
    )

    def retention(self) -> Retention:
        """The request's retention for prompt_cache_retention (see retention.py)."""
        return PROMPT_CACHE_RETENTION[self.prompt_cache_retention or "in_memory"]


class _GenerationRequest(PromptCacheFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, description="0 (or below 1e-5) is greedy; no upper bound, as vLLM")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, description="completions per prompt, at most the server's --max-n (default 128)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit; ids come from /tokenize"
    )
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, description="1 is none; > 1 discourages repeating")
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    cached_content: str | None = Field(None, max_length=MAX_CACHED_CONTENT_CHARS, description=CACHED_CONTENT)
    # prefixkv extension: usage.prompt_tokens_details.cache_miss says why the prompt was not all served from cache
    explain_cache_miss: bool = False
    # structured outputs (server/structured.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_n(self, max_n: int) -> None:
        """The server's cap on n: each completion is a sequence the engine schedules, so n is a work multiplier."""
        if self.n > max_n:
            raise APIError(f"n must be at most {max_n} on this server, got {self.n}", param="n", code="invalid_value")

    def output_constraint(self) -> StructuredOutputs | None:
        return from_openai(self.response_format, self.structured_outputs)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        constraint = self.output_constraint()
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=constraint,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=_token_biases(self.logit_bias),
            )
        except ValueError as exc:
            raise from_value_error(exc) from None


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings (JSON object keys): "50256" -> 50256."""
    if not logit_bias:
        return None
    bad = next((k for k in logit_bias if not k.isdigit()), None)
    if bad is not None:
        raise APIError(f"logit_bias keys must be token ids, got {bad!r}", param="logit_bias", code="invalid_value")
    return {int(k): v for k, v in logit_bias.items()}


class CompletionRequest(_GenerationRequest):
    FIELDS = COMPLETIONS
    prompt: str | list[int] | list[str | list[int]] = Field(
        description="a string, a list of token ids, or a list of either; at most the server's "
        "--max-prompts-per-request prompts (default 1024)"
    )
    max_tokens: int | None = Field(
        DEFAULT_COMPLETION_MAX_TOKENS, ge=1, description="null means OpenAI's default for completions, 16"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def prompts(self, max_prompts: int, max_n: int) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, a token-id list, or a list of either), within the
        server's caps: at most max_prompts prompts, and at most max(max_prompts, max_n) completions in all."""
        self.check_n(max_n)
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError("prompt must not be empty", param="prompt", code="invalid_value")
        if len(prompts) > max_prompts:
            raise APIError(
                f"prompt holds {len(prompts)} prompts; this server takes at most {max_prompts} per request",
                param="prompt",
                code="invalid_value",
            )
        max_completions = max(max_prompts, max_n)
        if len(prompts) * self.n > max_completions:
            raise APIError(
                f"{len(prompts)} prompts with n={self.n} ask for {len(prompts) * self.n} completions; "
                f"this server makes at most {max_completions} per request",
                param="n",
                code="invalid_value",
            )
        for x in prompts:
            if len(x) == 0:
                raise APIError("prompt must not be empty", param="prompt", code="invalid_value")
        return prompts

    def sampling_params(self) -> SamplingParams:
        """max_tokens null is OpenAI's default (16), not "up to the context end" (that is chat's default)."""
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class ChatCompletionRequest(_GenerationRequest):
    FIELDS = CHAT
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[Literal["text"]] | None = Field(None, description="text is the only output")
    # tool calls (prefixkv/tools/, server/openai_tools.py)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @cached_property
    def tool_spec(self) -> tuple[list[Tool], ToolChoice]:
        """The request's tools and tool choice, read and checked once."""
        return read_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    @property
    def reads_calls(self) -> bool:
        tools, choice = self.tool_spec
        return choice.reads_calls(tools)

    def output_constraint(self) -> StructuredOutputs | None:
        tools, choice = self.tool_spec
        try:
            return tool_constraint(tools, choice, super().output_constraint())
        except ValueError as exc:
            raise APIError(str(exc), param="tools", code="invalid_value") from None

    def sampling_params(self, max_n: int) -> SamplingParams:
        """max_completion_tokens wins over the deprecated max_tokens; neither means "up to the context end"."""
        self.check_n(max_n)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        """Messages in the plain {role, content: str} shape chat templates expect, the tools and calls written
        in (prefixkv/tools/prompt.py); 400 when they are not."""
        return template_messages(self.messages, self.tool_spec[0])


def template_messages(messages: list[dict[str, Any]], tools: list[Tool] | None = None) -> list[dict[str, str]]:
    """Messages in the plain {role, content: str} shape chat templates expect (an assistant's tool_calls and the
    tool messages written in as prompt.py says, with the tool block when tools are given); 400 when they are
    not."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(
                f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {role!r}",
                param="messages",
                code="invalid_value",
            )
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                is_text = isinstance(part, dict) and part.get("type") == "text"
                if not is_text or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{i}].content: only text parts are supported",
                        param="messages",
                        code="invalid_value",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(
                f"messages[{i}].content must be a string or a list of text parts",
                param="messages",
                code="invalid_value",
            )
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = read_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append(message)
    try:
        return render_messages(out, tools or [])
    except ValueError as exc:
        raise APIError(f"messages: {exc}", param="messages", code="invalid_value") from None
