"""What the engine needs of a grammar engine to constrain a request's output (prefixkv/grammar implements it).

The engine starts one ConstrainedOutput per constrained sequence at add_request (a bad schema, regex or grammar
is a ValueError there, so a 400 at the server's doors), asks it before each sampling step which tokens may come
next (a packed bitmask the runner applies to the logits: plain bytes, no tensor crosses), and tells it each
token sampled. With jump-forward on, it also asks which tokens the grammar forces next, and appends them without
sampling (engine.py). The grammar engine is handed to the engine by the composition root, so this package imports none.
"""

from __future__ import annotations

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
