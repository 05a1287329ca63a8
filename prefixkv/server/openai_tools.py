"""OpenAI's tool fields, read into prefixkv/tools/ (Tool, ToolChoice, ToolCall), and calls written back out.

- Chat Completions: `tools` [{"type": "function", "function": {name, description, parameters, strict}}],
  `tool_choice` "none" | "auto" | "required" | {"type": "function", "function": {"name"}}, `parallel_tool_calls`;
  an assistant message's `tool_calls` [{id, type, function: {name, arguments}}]; `tool` messages (tool_call_id).
- Responses: `tools` [{"type": "function", name, description, parameters, strict}], `tool_choice` the same
  strings or {"type": "function", "name"}.
The removed `functions` / `function_call` fields are a 400 naming their replacements. `strict: false` is held to
the schema all the same (as structured outputs are: a grammar either holds or is not asked for). Only function
tools exist here: a hosted tool type (web_search, file_search, ...) is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from prefixkv.server.errors import APIError
from prefixkv.tools.spec import EMPTY_PARAMETERS, Tool, ToolCall, ToolChoice, check_tools

REMOVED = {"functions": "tools", "function_call": "tool_choice"}
_TOOL_KEYS = {"name", "description", "parameters", "strict"}


def _bad(message: str, param: str) -> APIError:
    return APIError(message, param=param, code="invalid_value")


def _tool(spec: Any, param: str, nested: bool) -> Tool:
    if not isinstance(spec, dict) or spec.get("type") != "function":
        kind = spec.get("type") if isinstance(spec, dict) else None
        raise _bad(f"{param}.type must be function (only function tools are served), got {kind!r}", param)
    fields = spec.get("function") if nested else {k: v for k, v in spec.items() if k != "type"}
    if not isinstance(fields, dict):
        raise _bad(f"{param}.function must be an object", param)
    unknown = sorted(set(fields) - _TOOL_KEYS)
    if unknown:
        raise _bad(f"{param}: unknown field(s) {', '.join(unknown)}", param)
    if fields.get("strict") not in (None, True, False):
        raise _bad(f"{param}.strict must be true or false", param)
    try:
        return Tool(fields.get("name"), fields.get("description") or "", fields.get("parameters") or EMPTY_PARAMETERS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _bad(f"{param}: {exc}", param) from None


def _choice(value: Any, parallel: bool | None, nested: bool) -> ToolChoice:
    parallel = True if parallel is None else parallel
    if value is None or value in ("auto", "none", "required"):
        return ToolChoice(value or "auto", parallel=parallel)
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name") if nested else value.get("name")
        if isinstance(name, str):
            return ToolChoice("required", name=name, parallel=parallel)
    raise _bad("tool_choice must be none, auto, required or a function to call", "tool_choice")


def read_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, nested: bool = True
) -> tuple[list[Tool], ToolChoice]:
    """A request's tools and choice (nested: Chat Completions' {"function": {...}} shape; else Responses')."""
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    offered = [_tool(t, f"tools[{i}]", nested) for i, t in enumerate(tools or [])]
    choice = _choice(tool_choice, parallel, nested)
    try:
        check_tools(offered, choice)
    except ValueError as exc:
        raise _bad(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None
    return offered, choice


def read_calls(calls: Any, param: str) -> list[ToolCall]:
    """An assistant message's tool_calls (Chat Completions)."""
    if not isinstance(calls, list):
        raise _bad(f"{param} must be a list", param)
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _bad(f"{param}[{i}] must be {{id, type: function, function: {{name, arguments}}}}", param)
        out.append(ToolCall(str(c.get("id") or ""), fn["name"], fn["arguments"]))
    return out


def chat_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
