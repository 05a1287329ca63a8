"""The rows' sizes and prompts, plain Python so both venvs import it without torch.

Prompts are seeded random token ids, so both engines see the same ids bit for bit whatever their tokenizers do.
Ids come from [100, 40000): clear of SmolLM2's special ids (0-16) and inside its 49152-token vocabulary.
"""

from __future__ import annotations

import dataclasses
import random

FIRST_ID, END_ID = 100, 40000


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every length and count the rows use; FULL is the issue's, QUICK checks the script end to end in minutes."""

    system_tokens: int = 2048  # TTFT rows: a long system prompt ...
    question_tokens: int = 50  # ... plus a question of its own
    warm_repeats: int = 3  # warm TTFT: median of this many new questions after the cold one
    shared_prefix_tokens: int = 1024  # shared-prefix row: num_prompts x (prefix + own suffix)
    shared_suffix_tokens: int = 50
    num_prompts: int = 32  # prompts per throughput row (offline and served)
    output_tokens: int = 32  # output tokens per prompt, ignore_eos
    zero_hit_tokens: int = 512  # zero-hit row: unrelated prompts of this length
    # served prefix-repetition row (vLLM's prefix_repetition dataset): num_prompts prompts spread over
    # repeated_prefixes prefixes of repeated_prefix_tokens each, every prompt with a suffix of its own
    repeated_prefixes: int = 4
    repeated_prefix_tokens: int = 1024
    repeated_suffix_tokens: int = 64
    max_model_len: int = 4096  # scheduler limits, the same on both engines
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64  # offline rows: above num_prompts, so all prompts run together
    serve_max_num_seqs: int = 16  # the servers' limit (the issue's setting)
    kv_cache_bytes: int = 1 << 30  # both pools (prefixkv's default; vLLM's own would take most of free memory)


FULL = Sizes()
QUICK = Sizes(
    system_tokens=256,
    question_tokens=16,
    warm_repeats=3,
    shared_prefix_tokens=128,
    shared_suffix_tokens=16,
    num_prompts=4,
    output_tokens=4,
    zero_hit_tokens=64,
    repeated_prefixes=2,
    repeated_prefix_tokens=128,  # one of vLLM's 128-token blocks: a shorter prefix could never hit its cache
    repeated_suffix_tokens=16,
    max_model_len=1024,
    max_num_batched_tokens=256,  # below the TTFT prompt (272 tokens): its prefill is chunked, as at full size
)


def sizes_from_dict(d: dict) -> Sizes:
    return Sizes(**d)


class TokenSource:
    """Seeded token ids; the same seed gives the same sequence of prompts in any Python."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(FIRST_ID, END_ID) for _ in range(n)]


@dataclasses.dataclass
class OfflinePrompts:
    """Every prompt of the offline rows, drawn in one fixed order from one seed."""

    warmup_short: list[int]
    warmup_long: list[int]  # as long as the TTFT prompt, unrelated to it: first-use costs land here, untimed
    system: list[int]
    questions: list[list[int]]  # [0] is the cold question, the rest the warm ones
    shared: list[list[int]]
    zero_hit: list[list[int]]

    @classmethod
    def build(cls, sizes: Sizes, seed: int = 0) -> OfflinePrompts:
        src = TokenSource(seed)
        warmup_short = src.tokens(16)
        warmup_long = src.tokens(sizes.system_tokens + sizes.question_tokens)
        system = src.tokens(sizes.system_tokens)
        questions = [src.tokens(sizes.question_tokens) for _ in range(1 + sizes.warm_repeats)]
        prefix = src.tokens(sizes.shared_prefix_tokens)
        shared = [prefix + src.tokens(sizes.shared_suffix_tokens) for _ in range(sizes.num_prompts)]
        zero_hit = [src.tokens(sizes.zero_hit_tokens) for _ in range(sizes.num_prompts)]
        return cls(warmup_short, warmup_long, system, questions, shared, zero_hit)
