"""Request bodies of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), and where their
cache breakpoints fall.

Content is text blocks (a string is one) and tool_use / tool_result blocks; tools, tool_choice and those blocks
are read by anthropic_tools.py and written into the prompt as prefixkv/tools/prompt.py says. Other block types
and a final assistant message (a prefill to continue) get a 400 that says so. `cache_control` ({"type":
"ephemeral", "ttl": "5m" | "1h"}) on tool definitions, system and message blocks, and once at the top level
(automatic caching: the breakpoint is the end of the conversation), as Anthropic takes it: at most 4
breakpoints, and a 1h one never after a 5m one. Each breakpoint becomes a retention span of the engine request:
the prompt's tokens up to the breakpoint stay cached for the TTL, refreshed on hits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefixkv.sampling_params import SamplingParams
from prefixkv.server.anthropic_tools import ToolSpec, block_text, read_tools
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.protocol import CACHED_CONTENT, MAX_CACHED_CONTENT_CHARS
from prefixkv.server.request_fields import COUNT_TOKENS, MESSAGES, TableFields
from prefixkv.server.structured import from_anthropic
from prefixkv.tools.grammar import tool_constraint
from prefixkv.tools.prompt import tool_block, tool_block_through

CACHE_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # Anthropic's cap, the top-level one included
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CacheControl(BaseModel):
    model_config = _STRICT
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class Metadata(BaseModel):
    model_config = _STRICT
    user_id: str | None = Field(None, max_length=256)


@dataclass(frozen=True)
class Breakpoint:
    """A cache_control: the conversation cut right after the block that carries it (message index, and the
    text of that message up to and including the block; None for the top-level one: the whole conversation)."""

    where: str  # for errors: "system[0]", "messages[2].content[1]", "cache_control"
    ttl: str
    message: int | None = None
    text: str = ""


@dataclass(frozen=True)
class Conversation:
    """What the template renders (plain {role, content} messages) and the breakpoints, in prompt order."""

    messages: list[dict[str, str]]
    breakpoints: list[Breakpoint]

    def cut(self, bp: Breakpoint) -> list[dict[str, str]]:
        """The conversation up to the breakpoint, as messages (rendered without a generation prompt)."""
        if bp.message is None:
            return self.messages
        return [*self.messages[: bp.message], {**self.messages[bp.message], "content": bp.text}]


class MessagesRequest(TableFields):
    model_config = _STRICT
    FIELDS = MESSAGES

    model: str
    max_tokens: int = Field(ge=0, description="0 prewarms: the prompt is computed and cached, nothing generated")
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    # structured output: output_config.format (and the beta's output_format): {"type": "json_schema", "schema"}
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    cache_control: CacheControl | None = None
    # prefixkv / vLLM extensions, as on the OpenAI routes
    cache_salt: str | None = None
    priority: int = 0
    cached_content: str | None = Field(None, max_length=MAX_CACHED_CONTENT_CHARS, description=CACHED_CONTENT)
    explain_cache_miss: bool = False  # prefixkv's extension: usage.cache_miss says why the prompt missed the cache

    @property
    def user(self) -> str | None:
        """metadata.user_id: the tenant key of --tenant-isolation user (as OpenAI's `user`)."""
        return self.metadata.user_id if self.metadata else None

    @cached_property
    def tool_spec(self) -> ToolSpec:
        return read_tools(self.tools, self.tool_choice)

    @property
    def reads_calls(self) -> bool:
        return self.tool_spec.choice.reads_calls(self.tool_spec.tools)

    def sampling_params(self) -> SamplingParams:
        """Anthropic's defaults: temperature 1, every token (top_p 1, no top_k)."""
        spec = self.tool_spec
        try:
            constraint = tool_constraint(
                spec.tools, spec.choice, from_anthropic(self.output_config, self.output_format)
            )
            return SamplingParams(
                max_tokens=max(self.max_tokens, 1),
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if not self.top_k else self.top_k,
                stop=self.stop_sequences,
                structured_outputs=constraint,
            )
        except ValueError as exc:
            raise from_value_error(exc) from None

    def conversation(self) -> Conversation:
        return conversation_of(self.messages, self.system, self.cache_control, self.tool_spec)


def conversation_of(
    messages: list[dict[str, Any]],
    system: str | list[dict[str, Any]] | None,
    cache_control: CacheControl | None,
    tools: ToolSpec,
) -> Conversation:
    """The messages for the chat template and the cache breakpoints in prompt order; 400 when unsupported.
    With tools, the tool block opens the system message (Anthropic's order: tools, system, messages)."""
    rendered: list[dict[str, str]] = []
    breakpoints: list[Breakpoint] = []
    head = ""
    if tools.tools:
        for i, control in tools.cache_controls:
            breakpoints.append(_breakpoint(control, f"tools[{i}]", 0, tool_block_through(tools.tools, i)))
        head = tool_block(tools.tools) + ("\n\n" if system else "")
    if system is not None or head:
        text = _blocks_text(system or "", "system", 0, breakpoints, head)
        rendered.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(f"messages[{i}].role must be 'user' or 'assistant', got {role!r}", param="messages")
        content = m.get("content")
        if not isinstance(content, (str, list)):
            raise APIError(f"messages[{i}].content must be a string or a list of blocks", param="messages")
        text = _blocks_text(content, f"messages[{i}].content", len(rendered), breakpoints)
        rendered.append({"role": role, "content": text})
    if rendered[-1]["role"] == "assistant":
        raise APIError(
            "the last message must be a user message (continuing an assistant prefill is not supported)",
            param="messages",
        )
    if cache_control is not None:
        breakpoints.append(Breakpoint("cache_control", cache_control.ttl))
    _check_breakpoints(breakpoints)
    return Conversation(rendered, breakpoints)


def _blocks_text(
    content: str | list[dict[str, Any]], where: str, message: int, out: list[Breakpoint], head: str = ""
) -> str:
    """The text of a string or of blocks (text joined as it comes, tool blocks as anthropic_tools.py writes them),
    after `head`; each block's cache_control is added to out."""
    if isinstance(content, str):
        return head + content
    text = head
    after_result = False
    for j, block in enumerate(content):
        tool_text = block_text(block, f"{where}[{j}]", text) if isinstance(block, dict) else None
        if tool_text is not None:
            text += tool_text
            after_result = block.get("type") == "tool_result"
        elif isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            text += ("\n" if after_result else "") + block["text"]
            after_result = False
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(
                f"{where}[{j}]: only text, tool_use and tool_result blocks are supported, got {kind!r}",
                param=where.split("[")[0],
            )
        control = block.get("cache_control")
        if control is not None:
            out.append(_breakpoint(control, f"{where}[{j}]", message, text))
    return text


def _breakpoint(control: Any, where: str, message: int, text: str) -> Breakpoint:
    try:
        ttl = CacheControl.model_validate(control).ttl
    except ValueError:
        raise APIError(
            f"{where}.cache_control must be {{'type': 'ephemeral', 'ttl': '5m' | '1h'}}, got {control!r}",
            param=where.split("[")[0],
        ) from None
    return Breakpoint(where, ttl, message, text)


def _check_breakpoints(breakpoints: list[Breakpoint]) -> None:
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise APIError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided; found {len(breakpoints)}",
            param="cache_control",
        )
    for earlier, later in zip(breakpoints, breakpoints[1:]):
        if CACHE_TTL_SECONDS[later.ttl] > CACHE_TTL_SECONDS[earlier.ttl]:
            raise APIError(
                f"a cache_control with ttl '{later.ttl}' ({later.where}) must not come after one with ttl "
                f"'{earlier.ttl}' ({earlier.where}): longer TTLs come first",
                param="cache_control",
            )


class CountTokensRequest(TableFields):
    """POST /v1/messages/count_tokens: the fields that make the prompt. cached_content (prefixkv's extension)
    comes with the fields /v1/messages finds the entry by (metadata.user_id, cache_salt), so both count alike."""

    model_config = _STRICT
    FIELDS = COUNT_TOKENS

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: CacheControl | None = None
    metadata: Metadata | None = None
    cache_salt: str | None = None
    cached_content: str | None = Field(None, max_length=MAX_CACHED_CONTENT_CHARS, description=CACHED_CONTENT)

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata else None

    def conversation(self) -> Conversation:
        return conversation_of(self.messages, self.system, self.cache_control, read_tools(self.tools, self.tool_choice))
