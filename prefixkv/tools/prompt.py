"""The built-in tool prompt: how tools, calls and results are written into a chat, the same way on every API.

Why built-in: SmolLM2's chat template (plain ChatML) takes no tools, so the server writes them itself, into the
message contents, in one fixed form that the grammar (grammar.py) holds the model to and parse.py reads back:

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

The tool block goes first in the system message, before the client's own system prompt (Anthropic's cache order:
tools, then system, then messages): the same tools give the same leading tokens whatever follows. Every JSON
text here is canonical (keys sorted in tool definitions, no spaces), so the same tools always give the same
tokens; a call is written back compact with its keys in the order the model wrote them, so a call a client sends
back (OpenAI's arguments string, Anthropic's input object, Gemini's args) re-renders token for token as it was
generated, and the next turn reads it from the cache. Tool results go back as a user turn of <tool_response>
blocks, one per result, in the order given.
"""

from __future__ import annotations

import json
from typing import Any

from prefixkv.tools.spec import Tool, ToolCall

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEPARATOR = "\n"
RESPONSE_OPEN = "<tool_response>\n"
RESPONSE_CLOSE = "\n</tool_response>"

TOOLS_INTRO = "You can call functions. Their definitions, one JSON object per line:\n<tools>\n"
TOOLS_OUTRO = (
    "\n</tools>\n"
    "To call a function, answer with one block per call, its arguments a JSON object that fits its parameters:\n"
    f'{CALL_OPEN}{{"name":"<function name>","arguments":<arguments>}}{CALL_CLOSE}\n'
    f"Results come back inside {RESPONSE_OPEN.strip()}{RESPONSE_CLOSE.strip()} tags."
)


def canonical_json(value: Any) -> str:
    """Keys sorted, no spaces, characters as they are: the same value always gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def compact_json(value: Any) -> str:
    """No spaces, keys in their own order (a call's arguments as the grammar makes the model write them)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _definition(tool: Tool) -> str:
    fields = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return canonical_json({"type": "function", "function": fields})


def tool_block(tools: list[Tool]) -> str:
    return tool_block_through(tools, len(tools) - 1) + TOOLS_OUTRO


def tool_block_through(tools: list[Tool], index: int) -> str:
    """The tool block's text up to the end of tool `index`'s definition (where a breakpoint on that tool cuts)."""
    return TOOLS_INTRO + "\n".join(_definition(t) for t in tools[: index + 1])


def call_prefix(name: str) -> str:
    """What every call to `name` starts with, up to its arguments."""
    return CALL_OPEN + '{"name":' + json.dumps(name, ensure_ascii=False) + ',"arguments":'


CALL_SUFFIX = "}" + CALL_CLOSE


def call_text(call: ToolCall) -> str:
    return call_prefix(call.name) + canonical_arguments(call.arguments) + CALL_SUFFIX


def canonical_arguments(arguments: str | dict[str, Any]) -> str:
    """A call's arguments as they are written into the prompt: JSON text or an object, written compact in its own
    key order. Text that is not a JSON object is a ValueError."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ValueError(f"tool call arguments are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return compact_json(value)


def assistant_content(text: str, calls: list[ToolCall]) -> str:
    """An assistant turn's text and calls, as the model wrote them (text first, the calls right after it)."""
    return text + CALL_SEPARATOR.join(call_text(c) for c in calls)


def tool_results_content(results: list[str]) -> str:
    return "\n".join(RESPONSE_OPEN + r + RESPONSE_CLOSE for r in results)


def render_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """Plain {role, content} messages for the chat template, from messages that may carry calls and results:
    an assistant message's `tool_calls` (ToolCall) follow its text; consecutive `tool` messages become one user
    turn of results; with tools, the tool block opens the system message (a new one when there is none)."""
    out: list[dict[str, str]] = []
    results: list[str] = []
    for m in messages:
        if m["role"] == "tool":
            results.append(m["content"])
            continue
        if results:
            out.append({"role": "user", "content": tool_results_content(results)})
            results = []
        content = m["content"]
        if m.get("tool_calls"):
            content = assistant_content(content, m["tool_calls"])
        out.append({"role": m["role"], "content": content})
    if results:
        out.append({"role": "user", "content": tool_results_content(results)})
    if tools:
        block = tool_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": block + ("\n\n" + out[0]["content"] if out[0]["content"] else "")}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
