"""The output constraint for a tool choice: a Lark grammar (llguidance's dialect) that holds every call to the
built-in format (prompt.py) and to its function's JSON Schema, so even a 135M model's calls parse and validate.

- none: no call is read out of the answer, so no grammar beyond the client's own response format (if any).
- auto: free text with no call tag in it, or such text followed by calls. The text and the opening tag are one
  lexeme (text that ends at the first `<tool_call>`): the grammar engine's lexer is greedy, so a separate text
  lexeme would swallow the tag. A client's JSON response format replaces the free text (the answer is the JSON
  object, or calls).
- required: one call or more; a named choice: one call to that function, as vLLM and SGLang serve it (the client
  forced that call; a small model would otherwise repeat it until max_tokens).
- parallel off: exactly one call, and the grammar ends the answer after it.
Arguments are compact JSON (no free whitespace) in the schema's key order, as the structured outputs' JSON is.
"""

from __future__ import annotations

import json

from prefixkv.structured_outputs import StructuredOutputs
from prefixkv.tools.prompt import CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, call_prefix
from prefixkv.tools.spec import Tool, ToolChoice

COMPACT = {"whitespace_flexible": False}
# text up to and including the first call tag; the tag occurs once, at the end
TEXT_THEN_OPEN = r"/(?s:.*)<tool_call>\n/ & ~/(?s:.*<tool_call>..+)/"
TEXT_WITHOUT_TAG = r"/(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _schema(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)


def _text_rule(text: StructuredOutputs | None) -> str | None:
    """The answer's text part under a client's response format, or None for free text."""
    if text is None:
        return None
    if text.kind == "json":
        return "%json " + _schema(text.json if isinstance(text.json, dict) else {})
    if text.kind == "json_object":
        return "%json " + _schema({"type": "object"})
    raise ValueError(f"structured_outputs.{text.kind} cannot be combined with tools (a JSON schema or object can)")


def tool_constraint(tools: list[Tool], choice: ToolChoice, text: StructuredOutputs | None) -> StructuredOutputs | None:
    """The answer's constraint for these tools and this choice (None: unconstrained)."""
    if not tools or choice.mode == "none":
        return text
    offered = [t for t in tools if choice.name is None or t.name == choice.name]
    rules = [f"args{i}: %json {_schema(t.parameters)}" for i, t in enumerate(offered)]
    heads = [_lark_string(call_prefix(t.name)[len(CALL_OPEN) :]) for t in offered]
    bodies = " | ".join(f'{head} args{i} "}}"' for i, head in enumerate(heads))
    rules.append(f"body: {bodies}")
    parallel = choice.parallel and choice.name is None
    more = f"({_lark_string(CALL_CLOSE + CALL_SEPARATOR + CALL_OPEN)} body)*" if parallel else ""
    rest = f"body {more} {_lark_string(CALL_CLOSE)}"
    if choice.mode == "required":
        start = f"start: {_lark_string(CALL_OPEN)} {rest}"
    else:
        text_rule = _text_rule(text)
        if text_rule is None:
            start = f"start: TEXT | TEXT_THEN_OPEN {rest}"
            rules += [f"TEXT: {TEXT_WITHOUT_TAG}", f"TEXT_THEN_OPEN: {TEXT_THEN_OPEN}"]
        else:
            start = f"start: answer | {_lark_string(CALL_OPEN)} {rest}"
            rules.append(f"answer: {text_rule}")
    return StructuredOutputs(grammar="\n".join([start, *rules]) + "\n")
