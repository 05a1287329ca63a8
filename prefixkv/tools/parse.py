"""Reading calls back out of an answer written in the built-in format (prompt.py), whole or as it streams.

The grammar (grammar.py) makes a call's form certain, so reading is exact: the text before the first call tag is
the answer's text, then each block is one call. An answer cut short inside a call (finish reason `length`)
keeps its complete calls; the unfinished one is dropped, its text with it. Call ids are made here, one per call,
by the door's own id function.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from prefixkv.tools.prompt import CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, CALL_SUFFIX, canonical_arguments
from prefixkv.tools.spec import ToolCall

_NAME_HEAD = '{"name":'
_ARGS_HEAD = ',"arguments":'


def split_answer(text: str, new_id: Callable[[], str]) -> tuple[str, list[ToolCall]]:
    """The answer's text and its complete calls."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    at = start
    while text.startswith(CALL_OPEN, at):
        end = text.find(CALL_CLOSE, at)
        if end < 0:
            break
        call = _read_call(text[at + len(CALL_OPEN) : end], new_id)
        if call is None:
            break
        calls.append(call)
        at = end + len(CALL_CLOSE)
        if text.startswith(CALL_SEPARATOR + CALL_OPEN, at):
            at += len(CALL_SEPARATOR)
    return text[:start], calls


def _read_call(body: str, new_id: Callable[[], str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("name"), str)
        or not isinstance(value.get("arguments"), dict)
    ):
        return None
    return ToolCall(new_id(), value["name"], canonical_arguments(value["arguments"]))


@dataclass
class StreamEvent:
    """One increment of a streamed answer: text, a call's start (its name), or more of a call's arguments."""

    kind: str  # "text", "call", "arguments"
    index: int = 0  # the call's number in this answer (for "call" and "arguments")
    text: str = ""  # the text, the call's name, or the arguments' new characters
    call_id: str = ""


class CallStream:
    """Turns an answer's text increments into text, call and arguments events as soon as each is certain: text
    that may still become a call tag is held back, and so are the last characters of a call's arguments that may
    be its closing `}` and tag."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.buffer = ""  # received, not yet given out
        self.in_call = False
        self.name: str | None = None
        self.calls = 0  # calls begun
        self.complete = 0  # calls whose arguments are all given out
        self.seen_text = False

    def feed(self, delta: str) -> list[StreamEvent]:
        self.buffer += delta
        events: list[StreamEvent] = []
        while True:
            before = len(self.buffer), self.in_call, self.name
            events += self._step()
            if (len(self.buffer), self.in_call, self.name) == before:
                return events

    def _step(self) -> list[StreamEvent]:
        if not self.in_call:
            tag = self.buffer.find(CALL_OPEN)
            if self.calls:  # after a call only more calls follow: what lies between them is no text
                if tag >= 0:
                    self.buffer, self.in_call, self.name = self.buffer[tag + len(CALL_OPEN) :], True, None
                return []
            if tag < 0:
                keep = _tail_prefix(self.buffer, CALL_OPEN)
                text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return [StreamEvent("text", text=text)] if text else []
            text, self.buffer = self.buffer[:tag], self.buffer[tag + len(CALL_OPEN) :]
            self.in_call, self.name = True, None
            return [StreamEvent("text", text=text)] if text else []
        if self.name is None:
            head_end = self.buffer.find(_ARGS_HEAD)
            if head_end < 0:
                return []
            self.name = json.loads(self.buffer[len(_NAME_HEAD) : head_end])
            self.buffer = self.buffer[head_end + len(_ARGS_HEAD) :]
            self.calls += 1
            return [StreamEvent("call", self.calls - 1, self.name or "", self.new_id())]
        end = self.buffer.find(CALL_SUFFIX)
        if end >= 0:
            args, self.buffer = self.buffer[:end], self.buffer[end + len(CALL_SUFFIX) :]
            self.in_call = False
            self.complete += 1
            return [StreamEvent("arguments", self.calls - 1, args)] if args else []
        keep = min(len(self.buffer), len(CALL_SUFFIX) - 1)
        args, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return [StreamEvent("arguments", self.calls - 1, args)] if args else []

    def finish(self) -> list[StreamEvent]:
        """At the answer's end: held-back text goes out; an unfinished call's rest is dropped."""
        text, self.buffer = ("" if self.in_call or self.calls else self.buffer), ""
        return [StreamEvent("text", text=text)] if text else []


def _tail_prefix(text: str, tag: str) -> int:
    """How many of text's last characters are a proper start of tag (and so may still become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
