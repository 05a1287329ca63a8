"""The second KV tier's part in every engine step: KV copied between the tier and the pool at the right moments.

TieredKVCache decides what a step loads from the tier and saves into it; the pool's bytes belong to the model
runner. TierCopier joins them, as a step component of the engine core (prefixkv/engine/core.py):
- when a request is queued, the cache starts reading its chunks (prefetch), taking over what was read ahead of it
  (an agent session's turn, read back before its announced pause ended: engine/agent_sessions.py);
- before the forward pass, chunks to save are read out of the pool first (write_back: pages this step's
  allocations reuse), then the loads the step's admissions took are written into their pool slots;
- after the step, what it completed is read out and handed to the writer thread, which puts it into the tier;
  so are, once the step's outputs are processed, the finished agent turns the session pins demote;
- at close, what only the pool holds is saved, the writer drained and the tier closed;
- around each forward pass of a chunk's worth of tokens or more, it times the prefill, so a shared store knows
  what recomputing costs here against reading (remote_tier.py: load or recompute).
Built in the composition root (prefixkv.llm); the engine sees it only as a component.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from prefixkv.kvcache.offload.chained_tier import shared_store
from prefixkv.kvcache.offload.tier import KVTier
from prefixkv.kvcache.offload.tiered_cache import TieredKVCache
from prefixkv.kvcache.offload.writer import TierWriter
from prefixkv.request import Request


class KVPool(Protocol):
    """The pool's KV of some token slots as bytes, and back (the model runner's read_kv / write_kv)."""

    def read_kv(self, slots: list[int]) -> bytes: ...

    def write_kv(self, slots: list[int], payload: bytes, first_token: int = 0) -> None: ...


class TierCopier:
    def __init__(self, cache: TieredKVCache, tier: KVTier, pool: KVPool) -> None:
        """cache: the engine's KV manager over `tier`; pool: the runner that owns the KV tensors. The copier owns
        the tier from here (and its writer thread) and closes them in close()."""
        self.cache, self.tier, self.pool = cache, tier, pool
        self.writer = TierWriter(tier)
        self.write_seconds = 0.0  # loads copied into the pool
        self.store = shared_store(tier)
        self._forward_started = 0.0

    def on_add(self, request: Request) -> None:
        self.cache.prefetch(request)  # read its tier chunks while the engine steps

    def before_execute(self, scheduled: object) -> None:
        self._save()  # write_back: chunks whose pages this step's allocations reuse, before they change
        loads = self.cache.drain_loads()
        if loads:
            started = time.perf_counter()
            for load in loads:
                self.pool.write_kv(load.slots, load.payload, load.first_token)
            self.write_seconds += time.perf_counter() - started
        self._forward_started = time.perf_counter()

    def after_update(self, scheduled: object) -> None:
        tokens = getattr(scheduled, "num_batched_tokens", 0)
        if self.store is not None and tokens >= self.cache.chunk_tokens:  # a prefill: what a chunk costs to compute
            per_token = (time.perf_counter() - self._forward_started) / tokens
            known = self.store.recompute_seconds_per_token
            self.store.recompute_seconds_per_token = per_token if known is None else 0.8 * known + 0.2 * per_token
        self._save()

    def after_outputs(self) -> None:
        self._save()  # a finished agent turn's demotion (engine/agent_sessions.py): written in its pause

    def on_reset(self) -> None:
        pass

    def flush(self) -> None:
        """Wait until every chunk saved so far is in the tier, and every read started so far is done."""
        self.writer.flush()
        self.cache.wait_reads()

    def close(self) -> None:
        """Save what only the pool holds (write_back), finish the queued writes, close the cache's prefetching
        and the tier (a later engine on the same directory, or the same host tier, finds what this one stored)."""
        if self.writer.closed:
            return
        self.cache.save_all_pending()
        self._save()
        self.cache.close()
        self.writer.close()
        self.tier.close()

    def stats(self) -> dict[str, Any]:
        hits, tier = self.cache.tier_stats, self.tier.stats
        return dict(
            **(self.store.report() if self.store is not None else {}),
            kv_tier=self.tier.name,
            kv_pool_hit_tokens=hits.pool_hit_tokens,
            kv_tier_hit_tokens=hits.hit_tokens,
            kv_tier_loaded_bytes=hits.loaded_bytes,
            kv_tier_load_seconds=hits.read_seconds + self.write_seconds,
            kv_tier_entries=tier.entries,
            kv_tier_bytes=tier.bytes,
            kv_tier_capacity_bytes=self.tier.capacity_bytes,
            kv_tier_corrupt=tier.corrupt,
            kv_tier_saved_chunks=self.writer.written,
            kv_tier_dropped_saves=self.writer.dropped,
            kv_tier_read_ahead_chunks=hits.read_ahead_chunks,
            kv_tier_read_ahead_loaded_chunks=hits.read_ahead_loaded_chunks,
        )

    def _save(self) -> None:
        """Read the chunks the cache asks to save out of the pool now, before a load or a forward pass can
        overwrite their pages, and hand them to the writer thread (after close(), nothing more is stored)."""
        saves = self.cache.drain_saves()
        if self.writer.closed:
            return
        for save in saves:
            stored = (lambda save=save: self.cache.tier_stored(save)) if save.event is not None else None
            self.writer.submit(save.key, self.pool.read_kv(save.slots), stored)
