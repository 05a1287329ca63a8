"""A local tier (host RAM or a directory) in front of the shared store: the KV's third level, after the pool.

A read tries the local tier first, then the store; a chunk found only in the store is kept locally as well, so
the replica's next read of it is local. A write goes to both (the store skips a chunk another replica already
stored). The pair is one KVTier to the tiered cache; its stats are the local tier's, the store keeps its own.
"""

from __future__ import annotations

from prefixkv.kvcache.offload.remote_tier import RedisTier
from prefixkv.kvcache.offload.tier import KVTier, TierStats


class ChainedTier:
    """KVTier over `local` then `store` (both on the same manifest)."""

    def __init__(self, local: KVTier, store: RedisTier) -> None:
        if local.manifest != store.manifest:
            raise ValueError(f"the local tier and the store disagree: {local.manifest.differences(store.manifest)}")
        self.local, self.store = local, store
        self.name = f"{local.name}+{store.name}"
        self.manifest = local.manifest
        self.capacity_bytes = local.capacity_bytes
        self.stats: TierStats = local.stats  # the local tier's own object (the store's are store.stats)
        self.store_hits = 0  # gets the local tier missed and the store served

    def contains(self, key: bytes) -> bool:
        return self.local.contains(key) or self.store.contains(key)

    def get(self, key: bytes) -> bytes | None:
        payload = self.local.get(key)
        if payload is not None:
            return payload
        payload = self.store.get(key)
        if payload is not None:
            self.store_hits += 1
            self.local.put(key, payload)
        return payload

    def put(self, key: bytes, payload: bytes) -> None:
        self.local.put(key, payload)
        self.store.put(key, payload)

    def close(self) -> None:
        self.local.close()
        self.store.close()


def shared_store(tier: object) -> RedisTier | None:
    """The shared store behind a tier (itself, or a chained tier's), or None for a local-only tier."""
    if isinstance(tier, RedisTier):
        return tier
    return tier.store if isinstance(tier, ChainedTier) else None
