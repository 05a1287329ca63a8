"""release_retention (RetentionTable.release through each prefix cache): a retained prefix let go early (a deleted
or shortened server cache entry) stays cached as ordinary pages, keeps the pages it shares with another retained
prefix, and goes under the next flood, while the kept part survives it."""

from __future__ import annotations

import pytest

from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.kvcache.retention import RetentionTable
from tests.kvcache.helpers import make_request, run_to_completion

PAGE = 4
CASES = [("hash", "lru"), ("hash", "lfu"), ("radix", "lru"), ("radix", "cost")]


def make_cache(kind: str, eviction: str, num_pages: int = 32):
    cls = HashPrefixCache if kind == "hash" else RadixPrefixCache
    return cls(num_pages, PAGE, eviction=eviction, retained_pool_fraction=0.5)


def serve(kv, tokens, **kw) -> None:
    req = make_request(tokens, **kw)
    run_to_completion(kv, req)
    kv.free(req)
    kv.check_invariants()


def release(kv, tokens, keep_tokens: int = 0, **kw) -> int:
    """As Engine.release_retention probes: the prompt plus one token, so its last page counts."""
    probe = make_request([*tokens, 0], **kw)
    try:
        return kv.release_retention(probe, keep_tokens)
    finally:
        kv.free(probe)
        kv.check_invariants()


def hit(kv, tokens, **kw) -> int:
    probe = make_request([*tokens, 0], **kw)
    try:
        return kv.lookup(probe)
    finally:
        kv.free(probe)


def flood(kv, n: int) -> None:
    for i in range(n):
        serve(kv, list(range(50_000 + 100 * i, 50_000 + 100 * i + 3 * PAGE)))


def test_release_ends_retention_now_and_counts_only_retained_pages():
    table = RetentionTable(10, 0.5)
    ended: list[int] = []
    table.on_end = ended.append
    table.retain([1, 2, 3], 0, 1, 100.0)
    assert table.release([2, 3, 7]) == [2, 3] and ended == [2, 3]
    assert table.pages() == [1] and table.release([2]) == []
    table.retain([2], 1, 1, 100.0)  # retained again later: a fresh entry, its stale heap entries ignored
    table.check()
    assert sorted(table.pages()) == [1, 2]


@pytest.mark.parametrize("kind,eviction", CASES)
def test_released_pages_stay_cached_then_go_under_a_flood_while_kept_ones_stay(kind, eviction):
    kv = make_cache(kind, eviction)
    shared = list(range(1000, 1000 + 2 * PAGE))
    entry = shared + list(range(2000, 2000 + 2 * PAGE))  # 4 pages, 2 of them shared with another entry
    other = shared + list(range(3000, 3000 + 2 * PAGE))
    serve(kv, entry, retention_seconds=1000.0, retention_priority=1)
    serve(kv, other, retention_seconds=1000.0, retention_priority=1)
    assert len(kv.retention) == 6
    assert release(kv, entry, keep_tokens=len(shared) + 1) == 2  # a partly shared page is not kept
    assert len(kv.retention) == 4
    assert hit(kv, entry) == len(entry)  # released, not evicted
    flood(kv, 20)
    assert hit(kv, other) == len(other)  # still retained, the shared pages included
    assert hit(kv, entry) == len(shared)  # its own pages went with the flood
    assert release(kv, entry) == 2  # the shared pages: nothing past them is cached any more


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_release_in_another_namespace_or_of_nothing_cached_releases_nothing(kind):
    kv = make_cache(kind, "lru")
    tokens = list(range(1000, 1000 + 3 * PAGE))
    assert release(kv, tokens) == 0  # nothing retained at all
    serve(kv, tokens, retention_seconds=1000.0, cache_salt="a")
    assert release(kv, tokens, cache_salt="b") == 0
    assert release(kv, list(range(9000, 9000 + 3 * PAGE)), cache_salt="a") == 0
    assert release(kv, tokens, keep_tokens=len(tokens), cache_salt="a") == 0
    assert release(kv, tokens, cache_salt="a") == 3
    assert len(kv.retention) == 0


def test_a_parked_block_released_is_back_in_the_eviction_order():
    """The hash cache sets retained free blocks aside under pressure; released, they are evictable again."""
    kv = make_cache("hash", "lru", num_pages=16)
    entry = list(range(1000, 1000 + 4 * PAGE))
    serve(kv, entry, retention_seconds=1000.0, retention_priority=1)
    flood(kv, 8)  # fills the pool: the retained blocks get parked
    assert kv._parked and hit(kv, entry) == len(entry)
    assert release(kv, entry) == 4
    assert not kv._parked
    flood(kv, 8)
    assert hit(kv, entry) < len(entry)
