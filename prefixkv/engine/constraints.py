"""What the engine needs of a grammar engine to constrain a request's output (prefixkv/grammar implements it).

The engine starts one ConstrainedOutput per constrained sequence at add_request (a bad schema, regex or grammar
is a ValueError there, so a 400 at the server's doors), asks it before each sampling step which tokens may come
next (a packed bitmask the runner applies to the logits: plain bytes, no tensor crosses), and tells it each
token sampled. The grammar engine is handed to the engine by the composition root, so this package imports none.
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
