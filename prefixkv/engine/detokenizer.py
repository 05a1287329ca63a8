"""Turns generated token ids into text incrementally, and applies stop strings.

Decoding the whole output every step costs O(n) per token; instead only a short window is decoded: the text of
ids[prefix:] minus the text of ids[prefix:read] is what the newest tokens add. A window that ends inside a
multi-byte character decodes to U+FFFD; that text is held back until the character completes. The text only grows,
except that a stop string is cut off once it is complete: its first characters may already be in the text
(see holdback).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Iterable[str], include_stop: bool, skip_special_tokens: bool) -> None:
        self._decode = tokenizer.decode
        self.stop = list(stop)
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self._max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    @property
    def holdback(self) -> int:
        """Characters at the end of the text that a stop string completed by later tokens could still remove
        (its first len - 1 characters); a delta output sends them only once they are safe."""
        return max(0, self._max_stop - 1)

    def add(self, token_id: int) -> str | None:
        """Append one token; return the stop string that now ends the text, if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read], skip_special_tokens=self.skip_special)
        full_text = self._decode(self.ids[self._prefix :], skip_special_tokens=self.skip_special)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return None  # incomplete character, or nothing visible yet
        start = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._check_stop(start)

    def _check_stop(self, new_from: int) -> str | None:
        if not self.stop:
            return None
        search_from = max(0, new_from - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s
