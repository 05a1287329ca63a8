"""Request bodies of the OpenAI API (the fields prefixkv honours), plus vLLM's extensions.

Unknown fields are ignored, as OpenAI-compatible servers usually do; values are checked here for type and
by SamplingParams for range, so each bad field gets a 400 that names it.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefixkv.sampling_params import SamplingParams
from prefixkv.server.errors import APIError, from_value_error


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            )
        except ValueError as exc:
            raise from_value_error(exc) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, a token-id list, or a list of either)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError("prompt must not be empty", param="prompt", code="invalid_value")
        for x in prompts:
            if len(x) == 0:
                raise APIError("prompt must not be empty", param="prompt", code="invalid_value")
        if self.echo:
            raise APIError("echo is not supported", param="echo", code="unsupported")
        return prompts

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        """max_completion_tokens wins over the deprecated max_tokens; neither means "up to the context end"."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        """Messages in the plain {role, content: str} shape chat templates expect; 400 when they are not."""
        out = []
        for i, m in enumerate(self.messages):
            role = m.get("role")
            if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
                raise APIError(f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                               f"got {role!r}", param="messages", code="invalid_value")
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(f"messages[{i}].content: only text parts are supported",
                                       param="messages", code="invalid_value")
                    parts.append(part["text"])
                content = "".join(parts)
            elif not isinstance(content, str):
                raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                               param="messages", code="invalid_value")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return out
