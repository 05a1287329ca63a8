"""What generate() and Engine.step() return; shaped like vLLM's RequestOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from prefixkv.batch import Sample
from prefixkv.cache_miss import CacheMiss
from prefixkv.request import CacheWrites


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything generated so far (each output copies the last one and adds to it)
    DELTA = "delta"  # only the token ids, text and logprobs new since the request's previous output
    FINAL_ONLY = "final_only"  # one output, when the request finishes

    @classmethod
    def parse(cls, value: RequestOutputKind | str) -> RequestOutputKind:
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"output_kind must be one of {[k.value for k in cls]}, got {value!r}") from None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[Sample] | None = None  # per token: its id, logprob and top (id, logprob) alternatives
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """time.monotonic() stamps; first_token_time - arrival_time is the TTFT."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # the prompt tokens it wrote into the cache itself, and to a second tier (request.py, CacheWrites)
    cache_writes: CacheWrites = CacheWrites()
    metrics: RequestMetrics | None = None
    cache_miss: CacheMiss | None = None  # why the rest of the prompt was computed (cache_miss.py); None: not yet
    extra: dict = field(default_factory=dict)

    @property
    def num_written_tokens(self) -> int:
        """Prompt tokens this request wrote into the prefix cache itself (whole pages past its hit that were not
        cached before): the cache writes the usage of Anthropic's and OpenAI's APIs report."""
        return self.cache_writes.tokens
