"""A request's tools and its tool choice, in one shape for every API (each door converts its own JSON into these).

Checked here, once, whatever the API: names are what the APIs allow (letters, digits, `_`, `-`, `.`, at most 64),
no two tools share a name, a tool's parameters are a JSON Schema object, and a named choice names a tool that is
offered. A ValueError names what is wrong; the door answers it as a 400 in its own error shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, underscores, dashes or dots")
        if not isinstance(self.description, str):
            raise ValueError(f"tool {self.name!r}: description must be a string")
        if not isinstance(self.parameters, dict):
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON Schema object")
        kind = self.parameters.get("type", "object")
        if kind != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a schema of type object, got {kind!r}")


@dataclass(frozen=True)
class ToolChoice:
    """none: the model answers in text (the tools stay in the prompt, so its prefix stays cached); auto: text or
    calls, the model chooses; required: at least one call; a name: exactly that function. parallel: more than
    one call in one answer (OpenAI's parallel_tool_calls; Anthropic's disable_parallel_tool_use inverted)."""

    mode: Literal["none", "auto", "required"] = "auto"
    name: str | None = None  # with mode "required": this function only
    parallel: bool = True

    def reads_calls(self, tools: list[Tool]) -> bool:
        """Whether calls are read out of the answer: tools offered and a choice other than none."""
        return bool(tools) and self.mode != "none"


@dataclass(frozen=True)
class ToolCall:
    """A call as the model made it: arguments is the JSON text it wrote (compact, in the schema's key order)."""

    id: str
    name: str
    arguments: str


def check_tools(tools: list[Tool], choice: ToolChoice) -> None:
    """Duplicate names and a choice naming a tool that is not offered are errors."""
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"two tools are named {tool.name!r}: tool names must be unique")
        seen.add(tool.name)
    if choice.name is not None and choice.name not in seen:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    if choice.mode == "required" and not tools:
        raise ValueError("tool_choice asks for a tool call, but no tools were given")
