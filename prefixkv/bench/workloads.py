"""Synthetic prompts shared by the benchmarks (their summary statistics come from prefixkv.stats).

Prompts are random token ids rather than text so their lengths are exact (no tokenizer rounding) and a seed
reproduces them bit for bit. Special ids (BOS/EOS/chat markers) are left out: they could end a request early or
make the model behave unlike on ordinary text.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from prefixkv.stats import median, percentile, ratio, summarize

__all__ = [
    "TokenSampler",
    "sampler_for",
    "random_prompts",
    "shared_prefix_prompts",
    "median",
    "percentile",
    "ratio",
    "summarize",
]  # the statistics live in prefixkv.stats (the simulator uses them too)


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
