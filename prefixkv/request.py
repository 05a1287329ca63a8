"""A request's life inside the engine: its tokens, how many have KV, and why it ended.

A contract shared by the scheduler, the KV managers and the simulator, so it sits below all of them. The
scheduler is the only writer of a request's progress (num_computed_tokens, num_cached_tokens, cache_writes,
status); the KV managers read it and keep their own per-request state, typed, inside themselves.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prefixkv.cache_miss import CacheMiss
from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams
from prefixkv.session_hint import SessionHint


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its pages were released (they stay cached)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class MultiModalHash:
    """A multimodal input placed at prompt tokens [offset, offset + length), identified by its content hash."""

    offset: int
    length: int
    hash: str


Span = tuple[int, int]  # token positions [start, end)


def _union(runs: tuple[Span, ...], spans: Iterable[Span]) -> tuple[Span, ...]:
    """Sorted, disjoint runs covering `runs` and `spans` (touching runs are joined)."""
    merged: list[list[int]] = []
    for start, end in sorted([*runs, *spans]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)


@dataclass(frozen=True, slots=True)
class CacheWrites:
    """The prompt tokens a request wrote into the cache itself, as its KV manager reported each insert when the
    KV was computed (Scheduler.update records them; never derived from the prompt's length and the hit): `pool`,
    runs of whole pages it inserted into the prefix cache that were not cached before (a page another request
    cached first, in flight or earlier, is not in them); `tier`, runs of whole chunks it handed to a second tier to
    store (write_through; see kvcache/offload/tiered_cache.py). Only units wholly inside the prompt count, and
    pool pages only past the request's hit: a page read from the cache (a tier's load is inserted into the pool as
    if computed) is not also written. Frozen: an output may hold it while the request goes on."""

    pool: tuple[Span, ...] = ()
    tier: tuple[Span, ...] = ()

    @property
    def tokens(self) -> int:
        """Prompt tokens written into the prefix cache (the pool)."""
        return sum(end - start for start, end in self.pool)

    @property
    def tier_tokens(self) -> int:
        """Prompt tokens handed to the second tier."""
        return sum(end - start for start, end in self.tier)

    def tokens_below(self, position: int) -> int:
        """Written (pool) tokens before `position`: e.g. those a breakpoint's prefix retains."""
        return sum(max(0, min(end, position) - start) for start, end in self.pool if start < position)

    def plus(self, pool: Iterable[Span] = (), tier: Iterable[Span] = ()) -> CacheWrites:
        """These writes and more; a span written again (after an eviction and a recompute) counts once."""
        return CacheWrites(_union(self.pool, pool), _union(self.tier, tier))

    def union(self, other: CacheWrites) -> CacheWrites:
        return self.plus(other.pool, other.tier)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    # what the client asked for, as its door built it (request_options.py); a bare SamplingParams stands for
    # RequestOptions(sampling) (the simulator's and the tests' short form)
    options: RequestOptions
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    mm_hashes: tuple[MultiModalHash, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + generated, the sequence whose KV we hold
    num_computed_tokens: int = 0  # tokens of token_ids whose KV is in the request's pages
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    cache_miss: CacheMiss | None = None  # why the rest of the prompt missed, at first admission (cache_miss.py)
    cache_writes: CacheWrites = CacheWrites()  # what it wrote into the cache itself, as each commit reported it
    num_preemptions: int = 0
    arrival_step: int = 0  # engine step at which it arrived (for starvation bounds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    max_tokens: int = 0  # resolved by the engine against max_model_len

    def __post_init__(self) -> None:
        if isinstance(self.options, SamplingParams):
            self.options = RequestOptions(self.options)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    # -- the options, read where the scheduler, the caches and the policies need them -------------------------
    @property
    def sampling_params(self) -> SamplingParams:
        return self.options.sampling

    @property
    def priority(self) -> int:
        return self.options.priority

    @property
    def cache_salt(self) -> str | None:
        return self.options.cache_salt

    @property
    def lora_id(self) -> str | None:
        return self.options.lora_id

    @property
    def retention_seconds(self) -> float | None:
        return self.options.retention.seconds

    @property
    def retention_priority(self) -> int:
        return self.options.retention.priority

    @property
    def retention_spans(self) -> tuple[tuple[int, float], ...]:
        return self.options.retention.spans

    @property
    def retains(self) -> bool:
        """Whether it asked to keep any of its pages cached (retention seconds or spans)."""
        return self.options.retention.retains

    @property
    def prefill_only(self) -> bool:
        return self.options.prefill_only

    @property
    def prompt_cache_key(self) -> str | None:
        return self.options.prompt_cache_key

    @property
    def session(self) -> SessionHint | None:
        return self.options.session

    @property
    def held_elsewhere_tokens(self) -> int:
        return self.options.held_elsewhere_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def extra_keys(self) -> tuple:
        """What besides token ids decides whether KV can be shared: adapter and tenant salt."""
        return (self.lora_id, self.cache_salt)
