"""Builds the KV manager an EngineConfig names: the one module that knows every kind, so manager.py (the
interface) imports none of them."""

from __future__ import annotations

import time
from collections.abc import Callable

from prefixkv.choices import PREFIX_CACHES, check
from prefixkv.kvcache.eviction import make_eviction_policy
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.manager import KVCacheManager, PagedKVCache
from prefixkv.kvcache.no_cache import NoPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache


def create_kv_cache_manager(
    kind: str,
    num_pages: int,
    page_size: int,
    hash_algo: str = "sha256",
    eviction: str = "lru",
    retained_pool_fraction: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    miss_history: int | None = None,
    on_invalid_pages: Callable[[list[int]], None] | None = None,
) -> KVCacheManager:
    """eviction: one of eviction.EVICTION_POLICIES (ValueError otherwise); with caching off nothing is cached,
    so it is checked and then has nothing to choose. retained_pool_fraction and clock: see retention.py;
    miss_history: evicted pages remembered to explain misses (manager.PagedKVCache; -1: all); on_invalid_pages:
    told of pages whose KV nobody may read any more (PagedKVCache.watch_invalid_pages)."""
    make_eviction_policy(eviction)
    manager: PagedKVCache
    if kind == "off":
        manager = NoPrefixCache(num_pages, page_size)
        manager.watch_invalid_pages(on_invalid_pages)
        return manager
    check("prefix_cache", kind, PREFIX_CACHES)
    cache_class = HashPrefixCache if kind == "hash" else RadixPrefixCache
    manager = cache_class(
        num_pages,
        page_size,
        hash_algo=hash_algo,
        eviction=eviction,
        retained_pool_fraction=retained_pool_fraction,
        clock=clock,
        miss_history=miss_history,
    )
    manager.watch_invalid_pages(on_invalid_pages)
    return manager
