"""One request's options: built once at its door, validated once, carried unchanged into the engine.

What to sample (SamplingParams), and what the cache and scheduler should know of the request: its priority, the
namespace its KV may be shared in (cache salt, adapter), how long its pages stay cached (retention), the agent
session it is a turn of, the client's grouping hint, how much of its prompt a router says another replica holds,
and whether it only prewarms. Each door (the Python API, each HTTP dialect through server/request_options.py, the
prewarm file) builds one, so an option one door honours, every door honours; the engine's Request keeps it as it
came (request.py). Frozen: nothing downstream may change what a client asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prefixkv.sampling_params import SamplingParams
from prefixkv.session_hint import SessionHint


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep the pages the request computes or hits cached past its end (kvcache/retention.py), within the pool's
    retained_pool_fraction. seconds: all of them that long (0 or None: not at all); priority: among retained
    pages the lowest goes first; spans: (prefix tokens, seconds) pairs, each keeping the pages wholly inside its
    prefix that long (cache breakpoints: Anthropic's cache_control, a cached_content entry)."""

    seconds: float | None = None
    priority: int = 0
    spans: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        seconds = self.seconds
        if seconds is not None:
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
                raise ValueError(f"retention_seconds must be a finite number >= 0, got {seconds!r}")
            if seconds < 0:
                raise ValueError(f"retention_seconds must be a finite number >= 0, got {seconds!r}")
            object.__setattr__(self, "seconds", float(seconds) or None)
        if not _is_int(self.priority):
            raise ValueError(f"retention_priority must be an integer, got {self.priority!r}")
        object.__setattr__(self, "spans", _spans(self.spans))

    @property
    def retains(self) -> bool:
        """Whether it keeps any page at all."""
        return bool(self.seconds or self.spans)


def _spans(spans: object) -> tuple[tuple[int, float], ...]:
    if spans is None:
        return ()
    if not isinstance(spans, (list, tuple)):
        raise ValueError(f"retention_spans must be a list of (prefix tokens, seconds) pairs, got {spans!r}")
    out: list[tuple[int, float]] = []
    for span in spans:
        tokens, seconds = span if isinstance(span, (list, tuple)) and len(span) == 2 else (None, None)
        if (
            not _is_int(tokens)
            or tokens < 1  # type: ignore[operator]
            or not isinstance(seconds, (int, float))
            or isinstance(seconds, bool)
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(f"retention_spans: each span is (prefix tokens >= 1, seconds > 0), got {span!r}")
        out.append((int(tokens), float(seconds)))  # type: ignore[arg-type]
    return tuple(out)


NO_RETENTION = Retention()


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Everything a client says about one request besides its prompt (module docstring). A ValueError naming the
    field when one is bad: the Python API's error, a 400 at the server's doors."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first, like vLLM
    cache_salt: str | None = None  # the tenant namespace: part of every cache key
    lora_id: str | None = None  # the adapter: part of every cache key
    retention: Retention = NO_RETENTION
    session: SessionHint | None = None  # the agent session it is a turn of (engine/agent_sessions.py)
    prompt_cache_key: str | None = None  # the client's grouping hint (OpenAI's field): recorded, routed on
    # leading prompt tokens another replica holds, by a router's index: this one's misses there are `routed`
    held_elsewhere_tokens: int = 0
    prefill_only: bool = False  # prewarm: compute and cache the prompt, sample nothing, finish

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        self.sampling.validate()
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        for name in ("cache_salt", "lora_id", "prompt_cache_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
        if not isinstance(self.retention, Retention):
            raise ValueError(f"retention must be a Retention, got {type(self.retention).__name__}")
        if self.session is not None and not isinstance(self.session, SessionHint):
            raise ValueError(f"session must be a SessionHint, got {type(self.session).__name__}")
        if not _is_int(self.held_elsewhere_tokens) or self.held_elsewhere_tokens < 0:
            raise ValueError(f"held_elsewhere_tokens must be an integer >= 0, got {self.held_elsewhere_tokens!r}")
        if not isinstance(self.prefill_only, bool):
            raise ValueError(f"prefill_only must be True or False, got {self.prefill_only!r}")
        if self.prefill_only and self.sampling.n != 1:
            raise ValueError("a prefill-only (prewarm) request computes one prompt: n must be 1")
