"""Anthropic's tool fields, read into prefixkv/tools/, and its content blocks written into the prompt's text.

- `tools` [{name, description, input_schema, cache_control, type: "custom"}]: a `cache_control` on a tool is a
  breakpoint like any other: the prompt up to the end of that tool's definition in the tool block. Anthropic's
  server tools (web_search, bash, text_editor, ... : a versioned `type`) are a 400 naming the type.
- `tool_choice` {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}.
- An assistant's `tool_use` blocks {id, name, input} are written as calls (prompt.py's form), a user's
  `tool_result` blocks {tool_use_id, content, is_error} as results; an error result says so in its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixkv.server.errors import APIError
from prefixkv.tools.prompt import CALL_CLOSE, RESPONSE_CLOSE, RESPONSE_OPEN, call_text, compact_json
from prefixkv.tools.spec import EMPTY_PARAMETERS, Tool, ToolCall, ToolChoice, check_tools

_TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type"}
ERROR_RESULT = "(the tool reported an error) "


@dataclass(frozen=True)
class ToolSpec:
    tools: list[Tool]
    choice: ToolChoice
    cache_controls: list[tuple[int, Any]]  # (tool index, its cache_control), in order


def _bad(message: str, param: str) -> APIError:
    return APIError(message, param=param)


def read_tools(tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None) -> ToolSpec:
    offered, controls = [], []
    for i, spec in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(spec, dict):
            raise _bad(f"{where} must be an object", "tools")
        if spec.get("type") not in (None, "custom"):
            raise _bad(f"{where}.type {spec.get('type')!r}: only custom (client) tools are served", "tools")
        unknown = sorted(set(spec) - _TOOL_KEYS)
        if unknown:
            raise _bad(f"{where}: unknown field(s) {', '.join(unknown)}", "tools")
        try:
            offered.append(
                Tool(spec.get("name"), spec.get("description") or "", spec.get("input_schema") or EMPTY_PARAMETERS)  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise _bad(f"{where}: {exc}", "tools") from None
        if spec.get("cache_control") is not None:
            controls.append((i, spec["cache_control"]))
    choice = _choice(tool_choice)
    try:
        check_tools(offered, choice)
    except ValueError as exc:
        raise _bad(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None
    return ToolSpec(offered, choice, controls)


def _choice(value: dict[str, Any] | None) -> ToolChoice:
    if value is None:
        return ToolChoice("auto")
    kind = value.get("type") if isinstance(value, dict) else None
    parallel = not (isinstance(value, dict) and value.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return ToolChoice(kind, parallel=parallel)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool" and isinstance(value.get("name"), str):
        return ToolChoice("required", name=value["name"], parallel=parallel)
    raise _bad("tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice")


def block_text(block: dict[str, Any], where: str, after: str) -> str | None:
    """A tool_use or tool_result block as prompt text, joined to the text before it (`after`); None for
    another block type."""
    kind = block.get("type")
    if kind == "tool_use":
        name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
        if not isinstance(name, str) or not isinstance(args, dict):
            raise _bad(f"{where}: a tool_use block needs a name and an input object", "messages")
        joiner = "\n" if after.endswith(CALL_CLOSE) else ""  # text, then the calls (as the model writes them)
        return joiner + call_text(ToolCall(str(call_id or ""), name, compact_json(args)))
    if kind == "tool_result":
        content = block.get("content", "")
        if isinstance(content, list):
            if not all(isinstance(b, dict) and b.get("type") == "text" for b in content):
                raise _bad(f"{where}.content: only text blocks are supported in a tool result", "messages")
            content = "".join(b.get("text", "") for b in content)
        if not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or text blocks", "messages")
        text = (ERROR_RESULT if block.get("is_error") else "") + content
        return ("\n" if after else "") + RESPONSE_OPEN + text + RESPONSE_CLOSE
    return None
