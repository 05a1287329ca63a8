"""Counters the engine keeps so the server, the CLI and benchmarks can report them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_pages_total: int
    num_pages_used: int  # pages held by requests (cached-but-free pages count as free)
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    computed_tokens_total: int  # tokens that went through the model (prompt tokens minus hits, plus recompute)
    model_seconds_total: float = 0.0  # wall time inside the model runner (forward pass and sampling)
    # prefix_cache_queries/hits count first admissions only; a request re-admitted after preemption is counted here
    prefix_cache_readmission_queries: int = 0
    prefix_cache_readmission_hits: int = 0
    num_cached_pages: int = 0  # pages a lookup can find (held by requests or not): what a router's index mirrors
