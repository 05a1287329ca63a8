"""What a request's output must match: a JSON Schema, any JSON object, a regex, one of a few strings, or a Lark
grammar. Shaped like vLLM's StructuredOutputsParams (exactly one kind set); the grammar engine that enforces it
is prefixkv/grammar/ (llguidance). Plain data, checked here for shape only: whether a schema or a regex compiles
is the grammar engine's to say, at add_request (a ValueError naming the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict[str, Any] | str | None = None  # a JSON Schema (an object, or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # a Lark grammar (llguidance's dialect; its start rule is `start`)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)}, got {', '.join(given) or 'none'}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON Schema (an object)")
            object.__setattr__(self, "json", schema)
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The constraint's source in one canonical text (sorted keys, no spaces): compiled grammars are cached
        by it, so the same schema sent twice compiles once."""
        value = {"json": self.json, "json_object": True, "regex": self.regex, "choice": self.choice}.get(
            self.kind, self.grammar
        )
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))
