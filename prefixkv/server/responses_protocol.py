"""Request bodies of OpenAI's Responses API (POST /v1/responses): the fields prefixkv honours.

`input` is a string (one user message) or a list of items: messages ({"role", "content"} with content a string
or input_text / output_text parts; `"type": "message"` optional), `function_call` items (a call the model made:
call_id, name, arguments) and `function_call_output` items (its result: call_id, output); `instructions` becomes
a system message before them. `tools` are function tools (server/openai_tools.py), written into the prompt as
prefixkv/tools/prompt.py says. Other item types (images, files, reasoning) get a 400 that says so.

`include` may ask for "message.output_text.logprobs" (then `top_logprobs` alternatives per token, as OpenAI's) and
"reasoning.encrypted_content", which changes nothing (no reasoning items are produced); any other value is a 400
that names it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import ConfigDict, Field

from prefixkv.kvcache.retention import PROMPT_CACHE_RETENTION
from prefixkv.request_options import Retention
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.openai_tools import read_tools
from prefixkv.server.protocol import (
    CACHED_CONTENT,
    MAX_CACHED_CONTENT_CHARS,
    MAX_LOGPROBS,
    MAX_PROMPT_CACHE_KEY_CHARS,
)
from prefixkv.server.request_fields import RESPONSES, TableFields
from prefixkv.server.structured import from_responses_text
from prefixkv.tools.grammar import tool_constraint
from prefixkv.tools.spec import Tool, ToolCall, ToolChoice

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NO_EFFECT_INCLUDES = ("reasoning.encrypted_content",)  # no reasoning items are produced: nothing to include


class ResponsesRequest(TableFields):
    model_config = _STRICT
    FIELDS = RESPONSES

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=MAX_PROMPT_CACHE_KEY_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # text.format: structured output (server/structured.py)
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # prefixkv / vLLM extensions, as on the other OpenAI routes
    cache_salt: str | None = None
    priority: int = 0
    cached_content: str | None = Field(None, max_length=MAX_CACHED_CONTENT_CHARS, description=CACHED_CONTENT)
    explain_cache_miss: bool = False  # usage.input_tokens_details.cache_miss: why the input missed the cache

    def retention(self) -> Retention:
        return PROMPT_CACHE_RETENTION[self.prompt_cache_retention or "in_memory"]

    @cached_property
    def tool_spec(self) -> tuple[list[Tool], ToolChoice]:
        return read_tools(self.tools, self.tool_choice, self.parallel_tool_calls, nested=False)

    @property
    def reads_calls(self) -> bool:
        tools, choice = self.tool_spec
        return choice.reads_calls(tools)

    @cached_property
    def logprobs(self) -> int | None:
        """The alternatives per token when `include` asks for logprobs (None: not asked); a 400 for an `include`
        value this server does not produce, or top_logprobs without the include that returns them."""
        wanted = False
        for value in self.include or []:
            if value == LOGPROBS_INCLUDE:
                wanted = True
            elif value not in _NO_EFFECT_INCLUDES:
                raise APIError(
                    f"include value {value!r} is not served: this server produces only messages and function calls "
                    f"(it serves {LOGPROBS_INCLUDE!r})",
                    param="include",
                    code="unsupported",
                )
        if self.top_logprobs and not wanted:
            raise APIError(
                f"top_logprobs needs include to contain {LOGPROBS_INCLUDE!r}",
                param="top_logprobs",
                code="invalid_value",
            )
        return (self.top_logprobs or 0) if wanted else None

    def sampling_params(self) -> SamplingParams:
        """No max_output_tokens: up to the end of the context, as chat completions."""
        tools, choice = self.tool_spec
        try:
            constraint = tool_constraint(tools, choice, from_responses_text(self.text))
            return SamplingParams(
                max_tokens=self.max_output_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                logprobs=self.logprobs,
                structured_outputs=constraint,
            )
        except ValueError as exc:
            raise from_value_error(exc) from None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as messages (prompt.py's render_messages writes their calls and results); 400 for an item
        that is not a text message, a function call or a call's output."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise APIError("input must not be empty", param="input", code="invalid_value")
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            role = item.get("role")
            if kind == "function_call":
                out = with_call(out, _call(item, i))
                continue
            if kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    output = _text(output, i)
                out.append({"role": "tool", "content": output})
                continue
            if kind != "message" or role not in _ROLES:
                raise APIError(
                    f"input[{i}]: only function_call, function_call_output and message items with a role of "
                    f"{', '.join(_ROLES)} are supported (got type {kind!r}, role {role!r})",
                    param="input",
                    code="unsupported",
                )
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    f"input[{i}].content: only text parts are supported, got {kind!r}",
                    param="input",
                    code="unsupported",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"input[{i}].content must be a string or a list of text parts", param="input")


def _call(item: dict[str, Any], i: int) -> ToolCall:
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise APIError(f"input[{i}]: a function_call item needs a name and an arguments string", param="input")
    return ToolCall(str(item.get("call_id") or ""), name, arguments)


def with_call(messages: list[dict[str, Any]], call: ToolCall) -> list[dict[str, Any]]:
    """The messages with a call the model made: on its last assistant message when that is the last message
    (the text and the calls of one answer), else on a new one."""
    if messages and messages[-1]["role"] == "assistant":
        last = messages[-1]
        return [*messages[:-1], {**last, "tool_calls": [*last.get("tool_calls", []), call]}]
    return [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
