"""Per-request sampling settings, validated up front so bad values never reach the engine loop."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixkv.structured_outputs import StructuredOutputs

# Temperatures below this are greedy (vLLM's threshold): dividing logits by a denormal or a 1e-39 overflows
# them to inf and the softmax to NaN, and the limit of sampling as temperature -> 0 is the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# top_p below this keeps only the most likely token, exactly as the value asked for would: that token's
# probability is at least 1 / vocab, far above it. Raised to it so an fp32 sampler never sees a zero top_p.
MIN_TOP_P = 1e-8


def _is_number(x: object) -> bool:
    """A finite int or float; bools are not numbers here (True is not a temperature)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Shaped like vLLM's SamplingParams. temperature 0 (or below GREEDY_TEMPERATURE_EPS) means greedy.

    Every float field must be finite: NaN and infinities are a ValueError naming the field.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # what the output must match (grammar-constrained)
    # penalties, as vLLM and OpenAI define them: presence and frequency subtract from the logits of tokens the
    # output already holds (once, and once per occurrence); repetition (1.0: none) divides a positive logit of a
    # token in the prompt or the output and multiplies a negative one; logit_bias adds to the named tokens' logits
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # a max_tokens past what the context (and the KV pool) leaves is lowered to what fits instead of refused; the
    # answer then ends with finish_reason "length" there (clients that always ask for their own maximum)
    clamp_max_tokens: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        self.top_p = max(self.top_p, MIN_TOP_P)

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{field_name} {why}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be a finite number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be a finite number in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        # __post_init__ made both lists; None (set afterwards) means none, as the engine reads it
        for s in self.stop or ():
            if not isinstance(s, str) or not s:
                raise bad("stop", f"must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids or ():
            if not _is_int(t) or t < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be a finite number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be a finite number > 0 (1 is none), got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", f"must map token ids to numbers, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise bad("logit_bias", f"values must be finite numbers in [-100, 100], got {bias!r} for {token}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", f"must be StructuredOutputs, got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the sampler must see the request's tokens so far (any penalty set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias names tokens of this model only: checked when the request is added, as vLLM does."""
        for token in self.logit_bias or ():
            if token >= vocab_size:
                raise ValueError(f"logit_bias: token id {token} is out of range for a vocabulary of {vocab_size}")
