"""Counters the engine keeps so the server, the CLI and benchmarks can report them."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    jump_forward_tokens_total: int = 0  # of generation_tokens_total: forced by a grammar, appended unsampled
    model_seconds_total: float = 0.0  # wall time inside the model runner (forward pass and sampling)
    # prefix_cache_queries/hits count first admissions only; a request re-admitted after preemption is counted here
    prefix_cache_readmission_queries: int = 0
    prefix_cache_readmission_hits: int = 0
    num_cached_pages: int = 0  # pages a lookup can find (held by requests or not): what a router's index mirrors
    # missed prompt tokens of first admissions by cause (cache_miss.CAUSES); they sum to queries - hits
    prefix_cache_missed_by_cause: dict[str, int] = field(default_factory=dict)
    # the KV offload tier (kv_tier None: none configured, the rest stays 0)
    kv_tier: str | None = None  # "host" | "disk" | "remote" | "host+remote" | "disk+remote"
    kv_pool_hit_tokens: int = 0  # tokens admitted as cached from the pool (re-admissions included)
    kv_tier_hit_tokens: int = 0  # tokens admitted as cached from the tier, i.e. loaded instead of recomputed
    kv_tier_loaded_bytes: int = 0
    kv_tier_load_seconds: float = 0.0  # reading and verifying tier entries plus writing them into the pool
    kv_tier_entries: int = 0
    kv_tier_bytes: int = 0
    kv_tier_capacity_bytes: int = 0
    kv_tier_corrupt: int = 0  # entries found damaged and dropped (recomputed, never served)
    kv_tier_saved_chunks: int = 0  # chunks stored into the tier
    kv_tier_dropped_saves: int = 0  # chunks not stored because the writer's queue was full
    # chunks read back before an agent session's next turn arrived (session_policy +prefetch), and of those the
    # ones that turn loaded
    kv_tier_read_ahead_chunks: int = 0
    kv_tier_read_ahead_loaded_chunks: int = 0
    # the shared store behind the pool (kv_remote; kv_remote_status None: none configured), counted by the store's
    # tier (kvcache/offload/remote_tier.py): gets that found a chunk, gets that did not, chunks this replica
    # stored, puts skipped because the store had the chunk, puts the store refused (full), values of another
    # manifest, damaged values, calls that failed on the connection, and outages (up -> down)
    kv_remote_status: str | None = None  # "ok" | "degraded: <why>"
    kv_remote_hits: int = 0
    kv_remote_misses: int = 0
    kv_remote_stored: int = 0
    kv_remote_already_stored: int = 0
    kv_remote_refused: int = 0
    kv_remote_foreign: int = 0
    kv_remote_corrupt: int = 0
    kv_remote_unreachable: int = 0
    kv_remote_outages: int = 0
    kv_remote_skipped_recompute_cheaper: int = 0  # chunks recomputed because that was measured faster than a read
    kv_remote_bytes_read: int = 0
    kv_remote_bytes_written: int = 0
    kv_remote_read_seconds: float = 0.0
    # KV events (None: not published)
    kv_events_endpoint: str | None = None  # where the PUB socket is (its bound address when the port was *)
