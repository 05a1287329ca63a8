"""What the engine needs of a grammar engine to constrain a request's output (prefixkv/grammar implements it).

The engine starts one ConstrainedOutput per constrained sequence at add_request (a bad schema, regex or grammar
is a ValueError there, so a 400 at the server's doors). Before each sampling step it asks which tokens may come
next (a packed bitmask: plain bytes, no tensor crosses; the runner applies it to the logits, or for a greedy row
only when the token the model picked is not in it), and tells it each token sampled.
With jump-forward on, it also asks which tokens the grammar forces next, and appends them without sampling
(engine.py). The grammar engine is handed to the engine by the composition root, so this package imports none.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from prefixkv.structured_outputs import StructuredOutputs


class ConstrainedOutput(Protocol):
    def allowed(self) -> bytes:
        """The tokens that may come next: bit t of the little-endian 32-bit words is token t."""
        ...

    def accept(self, token_id: int) -> None:
        """The sampled token (always one allowed() admitted)."""
        ...

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would sample (empty when it has a choice). They
        end before any token that could merge with what follows, so the model's own tokenization of the rest is
        not cut off (token healing); the engine accepts each one it appends."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more: the output is complete."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher stopped working, if it did (never for tokens allowed() admitted)."""
        ...


class Grammars(Protocol):
    def start(self, constraint: StructuredOutputs) -> ConstrainedOutput:
        """A fresh matcher for one sequence (compiled once per constraint source); ValueError when it is bad."""
        ...


class GrammarStep:
    """One constrained row's grammar for one step: batch.py's TokenGate over its ConstrainedOutput. The mask is
    computed on the masks worker while the forward runs (llguidance drops the GIL) and waited for only before
    sampling. A greedy row without logprobs is checked after sampling (check_first): its argmax tested against
    the mask's bit, the mask applied only when the grammar refuses it. (llguidance's validate_tokens would skip
    the mask, but it admits tokens the mask refuses, e.g. '":' closing a JSON key: not the same answers.)"""

    __slots__ = ("check_first", "pending")

    def __init__(self, output: ConstrainedOutput, check_first: bool, masks: ThreadPoolExecutor) -> None:
        self.check_first = check_first
        self.pending: Future[bytes] = masks.submit(output.allowed)

    def mask(self) -> bytes:
        return self.pending.result()

    def admits(self, token_id: int) -> bool:
        mask = self.pending.result()
        return token_id >> 3 < len(mask) and bool(mask[token_id >> 3] >> (token_id & 7) & 1)
