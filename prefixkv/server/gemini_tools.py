"""Gemini's function calling, read into prefixkv/tools/, and its function parts written into the prompt's text.

- `tools` [{"functionDeclarations": [{name, description, parameters (Gemini's OpenAPI subset) or
  parametersJsonSchema, response}]}]: other tool kinds (googleSearch, codeExecution, urlContext, ...) are a 400
  naming the kind. A declaration's `response` schema describes what the function returns: accepted, no effect.
- `toolConfig.functionCallingConfig` {mode: AUTO | ANY | NONE | VALIDATED, allowedFunctionNames}: ANY is a
  required call, to one of allowedFunctionNames when given (all tools stay in the prompt, so its prefix stays
  cached; the grammar offers only the allowed ones); VALIDATED is AUTO (a call is always held to its schema).
- A model content's `functionCall` parts {name, args} are written as calls, a user content's `functionResponse`
  parts {name, response} as results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixkv.server.errors import APIError
from prefixkv.server.structured import openapi_to_json_schema
from prefixkv.tools.prompt import CALL_CLOSE, RESPONSE_CLOSE, RESPONSE_OPEN, call_text, compact_json
from prefixkv.tools.spec import EMPTY_PARAMETERS, Tool, ToolCall, ToolChoice, check_tools

_DECLARATION_KEYS = {"name", "description", "parameters", "parametersJsonSchema", "parameters_json_schema", "response"}
_MODES = {"AUTO": "auto", "VALIDATED": "auto", "ANY": "required", "NONE": "none", "MODE_UNSPECIFIED": "auto"}


@dataclass(frozen=True)
class ToolSpec:
    tools: list[Tool]  # every declared function, in order (the prompt's tool block)
    choice: ToolChoice
    allowed: list[Tool]  # the ones a call may name


def read_tools(tools: list[dict[str, Any]] | None, tool_config: dict[str, Any] | None) -> ToolSpec:
    declared: list[Tool] = []
    for i, entry in enumerate(tools or []):
        if not isinstance(entry, dict):
            raise APIError(f"tools[{i}] must be an object", param="tools")
        declarations = entry.get("functionDeclarations", entry.get("function_declarations"))
        other = [
            k for k, v in entry.items() if v is not None and k not in ("functionDeclarations", "function_declarations")
        ]
        if other:
            raise APIError(f"tools[{i}].{other[0]}: only functionDeclarations are served", param="tools")
        for j, d in enumerate(declarations or []):
            declared.append(_declaration(d, f"tools[{i}].functionDeclarations[{j}]"))
    config = (tool_config or {}).get("functionCallingConfig", (tool_config or {}).get("function_calling_config")) or {}
    mode = config.get("mode", "AUTO")
    if mode not in _MODES:
        raise APIError(f"toolConfig.functionCallingConfig.mode must be one of {', '.join(_MODES)}, got {mode!r}")
    names = config.get("allowedFunctionNames", config.get("allowed_function_names")) or []
    choice = ToolChoice(_MODES[mode])  # type: ignore[arg-type]
    try:
        check_tools(declared, choice)
    except ValueError as exc:
        raise APIError(str(exc), param="tools") from None
    unknown = [n for n in names if n not in {t.name for t in declared}]
    if unknown:
        raise APIError(f"allowedFunctionNames names {unknown[0]!r}, which is not among the functionDeclarations")
    if names and choice.mode != "required":
        raise APIError("allowedFunctionNames needs functionCallingConfig.mode ANY")
    allowed = [t for t in declared if not names or t.name in names]
    return ToolSpec(declared, choice, allowed)


def _declaration(d: Any, where: str) -> Tool:
    if not isinstance(d, dict):
        raise APIError(f"{where} must be an object", param="tools")
    unknown = sorted(set(d) - _DECLARATION_KEYS)
    if unknown:
        raise APIError(f"{where}: unknown field(s) {', '.join(unknown)}", param="tools")
    schema = d.get("parametersJsonSchema", d.get("parameters_json_schema"))
    if schema is None and d.get("parameters") is not None:
        schema = openapi_to_json_schema(d["parameters"])
    try:
        return Tool(d.get("name"), d.get("description") or "", schema or EMPTY_PARAMETERS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise APIError(f"{where}: {exc}", param="tools") from None


def part_text(extra: dict[str, Any], where: str, after: str) -> str | None:
    """A functionCall or functionResponse part as prompt text, joined to the text before it; None for another
    part kind."""
    call = extra.get("functionCall", extra.get("function_call"))
    if call is not None:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise APIError(f"{where}.functionCall needs a name (and args, an object)")
        args = call.get("args") or {}
        if not isinstance(args, dict):
            raise APIError(f"{where}.functionCall.args must be an object")
        joiner = "\n" if after.endswith(CALL_CLOSE) else ""
        return joiner + call_text(ToolCall(str(call.get("id") or ""), call["name"], compact_json(args)))
    result = extra.get("functionResponse", extra.get("function_response"))
    if result is not None:
        if not isinstance(result, dict) or not isinstance(result.get("name"), str):
            raise APIError(f"{where}.functionResponse needs a name and a response object")
        return ("\n" if after else "") + RESPONSE_OPEN + compact_json(result.get("response", {})) + RESPONSE_CLOSE
    return None
