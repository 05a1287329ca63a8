"""What the engine hands the model runner each step and gets back. Plain data below both: the runner sees page
tables, never the cache, and the engine never sees a tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prefixkv.sampling_params import SamplingParams


class TokenGate(Protocol):
    """A constrained row's grammar for one step, as the runner sees it (no grammar engine crosses)."""

    @property
    def check_first(self) -> bool:
        """True: sample from the unmasked logits and ask admits(); mask and sample again only when the token is
        refused. Exact for a greedy row without logprobs (an allowed argmax is the argmax of the allowed tokens),
        and no mask is applied on the steps where the model already follows the grammar."""
        ...

    def mask(self) -> bytes:
        """The tokens allowed next, a packed bitmask (bit t of the little-endian 32-bit words is token t); waits
        for one computed while the forward ran."""
        ...

    def admits(self, token_id: int) -> bool:
        """Whether the mask allows the token."""
        ...


@dataclass(slots=True)
class BatchItem:
    """One request's share of a forward pass."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or the one token of a decode)
    start_pos: int  # tokens of this request already in its pages; positions of token_ids start here
    page_table: list[int]  # page ids covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when the last token's logits are needed (prompt complete)
    sampling_params: SamplingParams
    num_output_tokens: int = 0  # tokens generated so far (seeded sampling draws stay reproducible)
    # structured outputs: the grammar's say over the next token (None: unconstrained)
    grammar: TokenGate | None = None
    # penalties (SamplingParams.penalized): the request's tokens so far, prompt then output, and how many are the
    # prompt's; None when no penalty is set, so an unpenalized step copies nothing
    history: list[int] | None = None
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class Sample:
    """The token the runner picked for one BatchItem, with its logprob when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
