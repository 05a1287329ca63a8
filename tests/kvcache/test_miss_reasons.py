"""Every missed prompt token gets a cause (kvcache/miss_reasons.py), the same in both prefix caches, and the
causes add up to the missed tokens exactly."""

from __future__ import annotations

import random

import pytest

from prefixkv.cache_miss import CAUSES
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.miss_reasons import FellOut
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from tests.kvcache.helpers import admit, compute, make_request

PAGE = 16  # the listener's unit: smaller pages are tracked 16 tokens at a time
KINDS = ["hash", "radix"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_cache(kind: str, num_pages: int = 16, clock: Clock | None = None, **kw):
    cls = HashPrefixCache if kind == "hash" else RadixPrefixCache
    return cls(num_pages, PAGE, clock=clock or Clock(), retained_pool_fraction=0.5, **kw)


def serve(kv, req):
    assert admit(kv, req)
    compute(kv, req)
    kv.free(req)
    kv.check_invariants()
    return req.cache_miss


def prompt(first: int, n: int = 10) -> list[int]:
    """n quarter pages of tokens (4 tokens each)."""
    return list(range(first, first + 4 * n))


@pytest.mark.parametrize("kind", KINDS)
def test_cold_prompt_is_never_seen_but_its_tail(kind):
    miss = serve(make_cache(kind), make_request(prompt(0, 10)))  # 2 coverable pages, 8 tokens of tail
    assert (miss.first_missed_token, miss.cause) == (0, "never_seen")
    assert miss.tokens_by_cause == {"never_seen": 32, "granularity": 8}


@pytest.mark.parametrize("kind", KINDS)
def test_a_warm_prompt_misses_only_what_no_hit_can_cover(kind):
    kv = make_cache(kind)
    serve(kv, make_request(prompt(0, 12)))
    miss = serve(kv, make_request(prompt(0, 12)))  # the last page holds the last token: never a hit
    assert (miss.first_missed_token, miss.cause, miss.tokens_by_cause) == (32, "granularity", {"granularity": 16})


@pytest.mark.parametrize("kind", KINDS)
def test_evicted_names_the_policy_and_when(kind):
    clock = Clock()
    kv = make_cache(kind, num_pages=6, clock=clock)
    serve(kv, make_request(prompt(0, 9)))
    clock.now += 5
    serve(kv, make_request(prompt(500, 21)))  # needs every page of the pool: the first prompt goes
    clock.now += 2
    miss = serve(kv, make_request(prompt(0, 9)))
    assert (miss.cause, miss.policy, miss.evicted_s_ago) == ("evicted", "lru", 2.0)
    assert miss.tokens_by_cause == {"evicted": 32, "granularity": 4}


@pytest.mark.parametrize("kind", KINDS)
def test_a_reset_is_an_eviction_by_reset(kind):
    kv = make_cache(kind)
    serve(kv, make_request(prompt(0, 9)))
    assert kv.reset_prefix_cache()
    miss = serve(kv, make_request(prompt(0, 9)))
    assert (miss.cause, miss.policy) == ("evicted", "reset")


@pytest.mark.parametrize("kind", KINDS)
def test_expired_when_the_retention_ran_out_before_the_eviction(kind):
    clock = Clock()
    kv = make_cache(kind, num_pages=6, clock=clock)
    serve(kv, make_request(prompt(0, 9), retention_seconds=10.0))
    clock.now += 11  # its retention is over: the next flood may take it
    serve(kv, make_request(prompt(500, 21)))
    miss = serve(kv, make_request(prompt(0, 9)))
    assert (miss.cause, miss.policy) == ("expired", "lru")
    kv2 = make_cache(kind, num_pages=6, clock=Clock())
    serve(kv2, make_request(prompt(0, 9)))
    serve(kv2, make_request(prompt(500, 21)))
    assert serve(kv2, make_request(prompt(0, 9))).cause == "evicted"  # never retained: plain eviction


@pytest.mark.parametrize("kind", KINDS)
def test_a_lapsed_page_the_cap_would_have_dropped_anyway_is_evicted_not_expired(kind):
    """Expired means the TTL decided: had the retention had no end, the cap (here 3 pages) would still hold the
    page. Once as many pages were retained after it, the cap would have let it go too: capacity's miss."""
    clock = Clock()
    kv = make_cache(kind, num_pages=6, clock=clock)
    serve(kv, make_request(prompt(0, 9), retention_seconds=10.0))
    serve(kv, make_request(prompt(200, 9), retention_seconds=10.0))  # 3 pages retained after the first's
    clock.now += 11
    serve(kv, make_request(prompt(500, 21)))
    assert serve(kv, make_request(prompt(0, 9))).cause == "evicted"
    assert serve(kv, make_request(prompt(200, 9))).cause == "expired"  # within the cap: the TTL's doing


@pytest.mark.parametrize("kind", KINDS)
def test_an_eviction_older_than_the_history_is_unknown_not_never_seen(kind):
    """The engine's history of evictions is bounded (here 2 pages): once the first prompt's evictions fell out of
    it, its miss reads unknown, apart from what was never cached at all."""
    kv = make_cache(kind, num_pages=6, miss_history=2)
    serve(kv, make_request(prompt(0, 9)))
    serve(kv, make_request(prompt(500, 21)))  # needs every page of the pool: the first prompt's 2 pages go
    assert kv.misses.explain(make_request(prompt(0, 9)), 0).cause == "evicted"
    serve(kv, make_request(prompt(2000, 21)))  # evicts the second prompt: the first one's evictions fall out
    miss = serve(kv, make_request(prompt(0, 9)))
    assert (miss.cause, miss.tokens_by_cause) == ("unknown", {"unknown": 32, "granularity": 4})
    assert serve(kv, make_request(prompt(9000, 9))).cause == "never_seen"


def test_what_fell_out_of_the_history_never_reads_never_seen():
    """FellOut is a Bloom filter: no key added is ever missed; keys never added rarely test positive."""
    fell = FellOut(1000)
    added = [((), k) for k in range(0, 4000, 4)]
    for key in added:
        fell.add(key)
    assert all(key in fell for key in added)
    others = [(("salt",), k) for k in range(20_000)]
    assert sum(key in fell for key in others) / len(others) < 1e-3
    assert ((), 1) not in FellOut(10)  # empty


@pytest.mark.parametrize("kind", KINDS)
def test_isolated_when_another_salt_holds_the_tokens(kind):
    kv = make_cache(kind)
    serve(kv, make_request(prompt(0, 9), cache_salt="tenant-a"))
    miss = serve(kv, make_request(prompt(0, 9), cache_salt="tenant-b"))
    assert (miss.cause, miss.tokens_by_cause) == ("isolated", {"isolated": 32, "granularity": 4})
    assert serve(kv, make_request(prompt(0, 9))).cause == "isolated"  # no salt: tenant-a's still isolates it
    assert serve(kv, make_request(prompt(100, 9), cache_salt="tenant-a")).cause == "never_seen"


@pytest.mark.parametrize("kind", KINDS)
def test_in_flight_while_another_request_computes_the_page(kind):
    kv = make_cache(kind)
    first = make_request(prompt(0, 17))
    assert admit(kv, first, budget=PAGE)  # a chunked prefill: one page computed, the rest to come
    compute(kv, first)
    second = make_request(prompt(0, 17))
    assert admit(kv, second)
    miss = second.cache_miss
    assert (miss.first_missed_token, miss.cause) == (PAGE, "in_flight")
    assert miss.tokens_by_cause == {"in_flight": 48, "granularity": 4}
    kv.free(first)
    kv.free(second)
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_routed_where_the_router_says_another_replica_holds_the_prefix(kind):
    """Request.held_elsewhere_tokens (the router's index, behind serve_ray): a missed page ending within them is
    routed, before evicted, after in_flight; the pages past them keep their own causes."""
    clock = Clock()
    kv = make_cache(kind, num_pages=6, clock=clock)
    miss = serve(kv, make_request(prompt(0, 13), held_elsewhere_tokens=40))  # pages end at 16, 32 | 48
    assert (miss.cause, miss.tokens_by_cause) == ("routed", {"routed": 32, "never_seen": 16, "granularity": 4})
    serve(kv, make_request(prompt(500, 21)))  # needs every page of the pool: the first prompt goes
    miss = serve(kv, make_request(prompt(0, 9), held_elsewhere_tokens=16))
    assert miss.tokens_by_cause == {"routed": 16, "evicted": 16, "granularity": 4}
    first = make_request(prompt(1000, 9))
    assert admit(kv, first, budget=PAGE)  # one page computed, the next in flight
    compute(kv, first)
    second = make_request(prompt(1000, 9), held_elsewhere_tokens=32)
    assert admit(kv, second) and second.cache_miss is not None
    assert second.cache_miss.tokens_by_cause == {"in_flight": 16, "granularity": 4}
    kv.free(first)
    kv.free(second)
    kv.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
def test_the_causes_sum_to_the_missed_tokens(kind):
    """Random prompts over a few shared prefixes, salts and retentions on a small pool: per request and in the
    stats, the causes sum to prompt minus hit; every cause is a known one."""
    rng = random.Random(7)
    clock = Clock()
    kv = make_cache(kind, num_pages=24, clock=clock)
    heads = [prompt(1000 * k, rng.randint(4, 20)) for k in range(6)]
    for _ in range(200):
        clock.now += rng.random()
        tokens = rng.choice(heads) + [rng.randint(0, 50) for _ in range(rng.randint(1, 12))]
        extra: dict[str, object] = {}
        if rng.random() < 0.3:
            extra["cache_salt"] = rng.choice(["a", "b"])
        if rng.random() < 0.3:
            extra["retention_seconds"] = rng.choice([0.5, 3.0])
        if rng.random() < 0.2:
            extra["held_elsewhere_tokens"] = rng.randint(0, len(tokens))
        req = make_request(tokens, **extra)
        miss = serve(kv, req)
        assert miss.missed_tokens == req.num_tokens - req.num_cached_tokens
        assert set(miss.tokens_by_cause) <= set(CAUSES)
    stats = kv.stats
    assert sum(stats.missed_by_cause.values()) == stats.queries - stats.hits
    assert {"evicted", "isolated", "never_seen", "granularity", "routed"} <= set(stats.missed_by_cause)


def test_one_token_pages_are_tracked_in_units_of_16_tokens():
    """A radix cache of one-token pages (SGLang's default): the listener keys every 16th page; a hit ending inside
    a unit blames the rest of that unit, and the partial unit at the end is granularity."""
    kv = RadixPrefixCache(256, 1, clock=Clock())
    serve(kv, make_request(list(range(40))))
    miss = serve(kv, make_request(list(range(20)) + [999] * 30))  # hit 20: tokens 20-31 of unit 1 never seen
    assert miss.first_missed_token == 20
    assert miss.tokens_by_cause == {"never_seen": 12 + 16, "granularity": 50 - 48}
    assert kv.misses.unit == 16
