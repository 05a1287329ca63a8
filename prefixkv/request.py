"""A request's life inside the engine: its tokens, how many have KV, and why it ended.

A contract shared by the scheduler, the KV managers and the simulator, so it sits below all of them. The
scheduler is the only writer of a request's progress (num_computed_tokens, num_cached_tokens, status); the KV
managers read it and keep their own per-request state, typed, inside themselves.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from prefixkv.cache_miss import CacheMiss
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


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    priority: int = 0  # lower runs first, like vLLM
    cache_salt: str | None = None
    lora_id: str | None = None  # adapter id: part of the cache key
    mm_hashes: tuple[MultiModalHash, ...] = ()
    retention_seconds: float | None = None  # keep the pages it computes or hits cached this long (retention.py)
    retention_priority: int = 0  # among retained pages, the lowest priority is evicted first
    # (prefix tokens, seconds): keep the pages wholly inside each prefix cached that long (cache breakpoints)
    retention_spans: tuple[tuple[int, float], ...] = ()
    prefill_only: bool = False  # prewarm: compute and cache the prompt, sample nothing, finish
    prompt_cache_key: str | None = None  # the client's grouping hint (OpenAI's field), recorded only
    session: SessionHint | None = None  # the agent session it is a turn of (engine/agent_sessions.py)
    # leading prompt tokens another replica holds, by the router's index: this one's misses there are `routed`
    held_elsewhere_tokens: int = 0

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + generated, the sequence whose KV we hold
    num_computed_tokens: int = 0  # tokens of token_ids whose KV is in the request's pages
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    cache_miss: CacheMiss | None = None  # why the rest of the prompt missed, at first admission (cache_miss.py)
    num_preemptions: int = 0
    arrival_step: int = 0  # engine step at which it arrived (for starvation bounds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    max_tokens: int = 0  # resolved by the engine against max_model_len

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def retains(self) -> bool:
        """Whether it asked to keep any of its pages cached (retention_seconds or retention_spans)."""
        return bool(self.retention_seconds or self.retention_spans)

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
