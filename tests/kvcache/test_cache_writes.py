"""What commit() reports a request inserted (Inserted), without a model: only the cache's own inserts count, and
CacheWrites keeps the prompt's part of them. The engine's end-to-end counts: tests/engine/test_cache_writes.py."""

from __future__ import annotations

import pytest

from prefixkv.engine.scheduler import record_writes
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.manager import NOTHING_INSERTED
from prefixkv.kvcache.offload.host_tier import HostTier
from prefixkv.kvcache.offload.tier import TierManifest
from prefixkv.kvcache.offload.tiered_cache import TieredKVCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.request import CacheWrites
from tests.kvcache.helpers import admit, make_request

PROMPT = list(range(100, 200))  # 6 whole pages of 16 and a partial one


def computed(kv, req):
    """Pretend the forward pass computed the allocated tokens; what commit() reported, recorded as the scheduler
    does."""
    req.num_computed_tokens = min(req.num_tokens, len(kv.page_table(req)) * kv.page_size)
    inserted = kv.commit(req)
    record_writes(req, inserted)
    kv.check_invariants()
    return inserted


@pytest.mark.parametrize("kind, b_hit", [("hash", 96), ("radix", 0)])
def test_the_first_to_compute_a_page_writes_it(kind, b_hit):
    """Two requests admitted together: the hash cache's second hits the first's pages keyed in flight; the radix
    cache's second (no scheduler here to defer it) computes them too, and its commit shares the first's."""
    kv = HashPrefixCache(32, 16) if kind == "hash" else RadixPrefixCache(32, 16)
    a, b = make_request(PROMPT), make_request(PROMPT)
    assert admit(kv, a) and kv.lookup(b) == b_hit and admit(kv, b)
    assert computed(kv, a).pool == ((0, 96),)
    assert computed(kv, b) == NOTHING_INSERTED
    assert a.cache_writes.pool == ((0, 96),) and b.cache_writes == CacheWrites()


def test_pages_keyed_in_flight_and_taken_back_were_never_written():
    """A request freed before its step ran (preempted in the step that allocated it): its in-flight keys are
    taken back, nothing was written; computed later, it writes them then."""
    kv = HashPrefixCache(32, 16)
    a = make_request(PROMPT)
    assert admit(kv, a) and kv.num_cached_pages() == 6  # keyed in flight
    kv.free(a)
    assert kv.num_cached_pages() == 0 and a.cache_writes == CacheWrites()
    a.num_computed_tokens = 0
    assert admit(kv, a)
    assert computed(kv, a).pool and a.cache_writes.tokens == 96


def test_only_whole_prompt_pages_past_the_hit_are_recorded():
    kv = RadixPrefixCache(32, 16)
    a = make_request(PROMPT[:96])
    assert admit(kv, a)
    computed(kv, a)
    a.token_ids += [7] * 16  # generated tokens fill a page of their own: inserted, but no prompt write
    a.num_computed_tokens = a.num_tokens
    assert kv.allocate(a, 0) and kv.commit(a).pool == ((96, 112),)
    assert a.cache_writes.pool == ((0, 96),)


@pytest.mark.parametrize("policy, tier_spans", [("write_through", ((0, 96),)), ("write_back", ())])
def test_a_tier_write_is_a_chunk_handed_over_at_commit(policy, tier_spans):
    """write_through: each whole chunk the tier lacked, once; write_back stores at eviction, for no request."""
    tier = HostTier(1 << 20, TierManifest("m", "float32", 32, 8, "sha256"))
    kv = TieredKVCache(HashPrefixCache(32, 16), tier, 32, "sha256", policy)
    a = make_request(PROMPT)
    assert admit(kv, a)
    assert computed(kv, a).tier == tier_spans
    assert a.cache_writes.tier == tier_spans and a.cache_writes.tokens == 96
    kv.free(a)


def test_cache_writes_count_a_rewrite_once_and_split_at_a_position():
    writes = CacheWrites().plus([(0, 16), (16, 32), (64, 80)]).plus([(16, 32), (32, 48)])
    assert writes.pool == ((0, 48), (64, 80)) and writes.tokens == 64
    assert writes.tokens_below(32) == 32 and writes.tokens_below(70) == 54 and writes.tokens_below(0) == 0
    assert writes.union(CacheWrites(tier=((0, 32),))).tier_tokens == 32
