"""Synthetic prompts and summary statistics shared by the benchmarks.

Prompts are random token ids rather than text so their lengths are exact (no tokenizer rounding) and a seed
reproduces them bit for bit. Special ids (BOS/EOS/chat markers) are left out: they could end a request early or
make the model behave unlike on ordinary text.
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence


class TokenSampler:
    """Draws seeded random token ids from a vocabulary, never a special id."""

    def __init__(self, vocab_size: int, special_ids: Iterable[int] = (), seed: int = 0) -> None:
        special = {int(t) for t in special_ids if 0 <= int(t) < vocab_size}
        self.allowed = [t for t in range(vocab_size) if t not in special]
        if not self.allowed:
            raise ValueError("the vocabulary has no ordinary tokens to sample from")
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.choice(self.allowed) for _ in range(n)]

    def prompts(self, num: int, length: int) -> list[list[int]]:
        return [self.tokens(length) for _ in range(num)]


def sampler_for(llm, seed: int = 0) -> TokenSampler:
    """A TokenSampler over the ids both the model and its tokenizer know, minus the tokenizer's special ids."""
    engine = llm.llm_engine
    hf = engine.tokenizer.hf
    vocab = min(engine.model_config.vocab_size, len(hf))
    special = set(getattr(hf, "all_special_ids", ()) or ()) | set(engine.tokenizer.eos_token_ids)
    return TokenSampler(vocab, special, seed)


def random_prompts(sampler: TokenSampler, num: int, length: int) -> list[list[int]]:
    """num unrelated prompts of exactly `length` tokens (no shared prefix beyond chance)."""
    return sampler.prompts(num, length)


def shared_prefix_prompts(sampler: TokenSampler, num: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    """num prompts = one common prefix + a unique suffix each (the system-prompt / few-shot pattern)."""
    prefix = sampler.tokens(prefix_len)
    return [prefix + sampler.tokens(suffix_len) for _ in range(num)]


# -- statistics -------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method), p in [0, 100]; nan for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(values: Sequence[float]) -> dict:
    """The usual latency summary: what a reader wants to compare two runs by."""
    values = list(values)
    return {"n": len(values), "mean": statistics.fmean(values) if values else math.nan,
            "median": median(values), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "min": min(values, default=math.nan), "max": max(values, default=math.nan)}


def ratio(a: float, b: float) -> float:
    """a / b, nan instead of an exception when b is zero (a broken run should still print its table)."""
    return a / b if b else math.nan
