"""Prefix caching off: the same block pool and accounting as the hash cache, with no keys and no hits."""

from __future__ import annotations

from prefixkv.kvcache.hash_cache import HashPrefixCache


class NoPrefixCache(HashPrefixCache):
    name = "off"
    caching = False
