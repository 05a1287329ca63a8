"""Structured outputs enforced by llguidance (pinned in pyproject.toml): one matcher per constrained sequence.

Why llguidance: it is one of the two grammar engines vLLM and SGLang use (with xgrammar), it compiles JSON Schema,
regexes and Lark grammars into one Earley parser over the model's own token trie, computes a step's token mask in
tens of microseconds on a CPU (measured here: 82 us for SmolLM2's 49,152 tokens), needs no torch (the engine core
imports none), and bounds its own work: grammar construction and every mask step run on fuel limits
(LLParserLimits), so a pathological schema is an error, never a stuck step. It also says which tokens a grammar
forces next (compute_ff_tokens), what jump-forward needs.

The tokenizer's llguidance view is built once per tokenizer (~0.3 s, the first constrained request pays it);
compiled grammars are cached by their source (StructuredOutputs.key): each sequence gets a copy of the compiled
matcher, so the same schema sent twice compiles once. JSON is compiled compact (no free whitespace between
tokens: a small model otherwise may emit whitespace without end) with the properties in the schema's order.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from prefixkv.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

CACHED_GRAMMARS = 256
# llguidance's view of each Hugging Face tokenizer in use (by vocabulary size and EOS), built once per process
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, int | None], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_text(constraint: StructuredOutputs) -> str:
    """llguidance's grammar for the constraint (not yet checked: the matcher does that)."""
    kind = constraint.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.json, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)  # type: ignore[arg-type]
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice or ())
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)  # type: ignore[arg-type]


class LLGuidanceOutput:
    """One sequence's matcher (engine/constraints.py's ConstrainedOutput)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def allowed(self) -> bytes:
        return self.matcher.compute_bitmask()

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    def forced(self) -> list[int]:
        # llguidance's fast-forward tokens: already cut before the last token a longer one could replace
        return self.matcher.compute_ff_tokens()

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class LLGuidanceGrammars:
    """engine/constraints.py's Grammars over a Hugging Face fast tokenizer. Thread-safe: the server compiles
    nothing on its event loop, but engines of one process may share it."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.eos_token_id = min(eos_token_ids) if eos_token_ids else None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (a cached source compiles nothing)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            key = (self.vocab_size, self.eos_token_id)
            mine = _TOKENIZERS.setdefault(self.hf_tokenizer, {})
            if key not in mine:  # engines on one loaded model share it
                mine[key] = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            self._tokenizer = mine[key]
        return self._tokenizer

    def start(self, constraint: StructuredOutputs) -> LLGuidanceOutput:
        key = constraint.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                try:
                    grammar = grammar_text(constraint)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{constraint.kind}: {exc}") from None
                compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
                if compiled.is_error():
                    raise ValueError(f"structured_outputs.{constraint.kind} cannot be used: {compiled.get_error()}")
                self.compiles += 1
                self._compiled[key] = compiled
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return LLGuidanceOutput(compiled.deep_copy())
