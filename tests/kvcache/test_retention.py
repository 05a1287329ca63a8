"""Per-request retention (kvcache/retention.py) in both prefix caches: retained pages outlive a flood, decay after
their deadline, stay under the cap, and never make an allocation fail."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.kvcache.retention import RetentionTable
from prefixkv.request_options import Retention
from tests.kvcache.helpers import admit, compute, make_request, run_to_completion

PAGE = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cache(kind: str, eviction: str, num_pages: int, clock: FakeClock, fraction: float = 0.25):
    if kind == "hash":
        return HashPrefixCache(num_pages, PAGE, eviction=eviction, retained_pool_fraction=fraction, clock=clock)
    return RadixPrefixCache(num_pages, PAGE, eviction=eviction, retained_pool_fraction=fraction, clock=clock)


def serve(kv, req) -> None:
    run_to_completion(kv, req)
    kv.free(req)


def cached_pages(kv) -> set[int]:
    if isinstance(kv, HashPrefixCache):
        return {b.block_id for b in kv.cached.values()}
    return {p for node in kv.tree.nodes() for p in node.pages}


def unheld_pages(kv) -> tuple[int, set[int]]:
    """(free pages holding nothing cached, cached pages no request holds)."""
    if isinstance(kv, HashPrefixCache):
        free = [b for b in kv.blocks if b.ref_cnt == 0]
        return sum(1 for b in free if b.block_hash is None), {b.block_id for b in free if b.block_hash is not None}
    unlocked = {p for node in kv.tree.nodes() if node.lock_ref == 0 for p in node.pages}
    return len(kv._free), unlocked


CASES = [("hash", "lru"), ("hash", "lfu"), ("radix", "lru"), ("radix", "cost")]


@pytest.mark.parametrize("kind,eviction", CASES)
def test_retained_prefix_survives_a_flood_then_decays(kind, eviction):
    clock = FakeClock()
    kv = make_cache(kind, eviction, 32, clock)
    system = list(range(1000, 1000 + 4 * PAGE))  # 4 pages, under the cap of 8
    serve(kv, make_request(system + [1], retention_seconds=10.0, retention_priority=1))
    for i in range(60):  # each flood request takes 3 pages of a 32-page pool: everything unretained churns
        clock.now += 0.1
        serve(kv, make_request([5000 + 20 * i + k for k in range(3 * PAGE)]))
        kv.check_invariants()
    probe = make_request(system + [2])
    assert kv.lookup(probe) == len(system), "the retained prefix was evicted by unrelated requests"
    clock.now += 10.0  # past the deadline: ordinary pages again, and the flood takes them
    for i in range(60):
        serve(kv, make_request([9000 + 20 * i + k for k in range(3 * PAGE)]))
        kv.check_invariants()
    assert len(kv.retention) == 0
    assert kv.lookup(make_request(system + [3])) == 0


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_cap_releases_the_weakest_retention(kind):
    clock = FakeClock()
    kv = make_cache(kind, "lru", 16, clock, fraction=0.25)  # cap: 4 pages
    strong = list(range(100, 100 + 3 * PAGE))
    serve(kv, make_request(strong + [1], retention_seconds=100.0, retention_priority=5))
    weak = list(range(200, 200 + 3 * PAGE))
    serve(kv, make_request(weak + [1], retention_seconds=100.0))
    kv.check_invariants()
    assert len(kv.retention) == kv.retention.capacity == 4
    assert kv.retention.released_by_cap == 2  # the weak request's two deepest pages
    retained = set(kv.retention.pages())
    assert len(retained & cached_pages(kv)) == 4
    summary = kv.summary()
    assert summary.retained_pages == 4 and summary.retention_released_by_cap == 2
    assert kv.reset_prefix_cache()  # an explicit reset drops retained KV too
    assert len(kv.retention) == 0 and kv.lookup(make_request(strong + [2])) == 0
    kv.check_invariants()


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_spans_retain_their_prefixes_for_their_own_time_and_a_hit_refreshes_them(kind):
    """Cache breakpoints: a 1 h span over the first 2 pages and a 5 min one over 3 (longer first, as Anthropic
    orders them); a page under both keeps the longer; pages past every span are not retained; a hit re-retains."""
    clock = FakeClock()
    kv = make_cache(kind, "lru", 32, clock)
    tokens = list(range(100, 100 + 5 * PAGE))
    spans = ((2 * PAGE, 3600.0), (3 * PAGE + 1, 300.0))  # the second ends inside page 3: pages 0-2 only
    serve(kv, make_request(tokens, retention_spans=spans))
    assert len(kv.retention) == 3
    clock.now += 299.0
    assert len(kv.retention) == 3 and not kv.retention.expire()
    serve(kv, make_request(tokens[: 3 * PAGE] + [7], retention_spans=spans))  # a hit refreshes the 5 min span
    clock.now += 299.0
    assert not kv.retention.expire() and len(kv.retention) == 3
    clock.now += 2.0  # 301 s after the refresh: the 5 min page is ordinary again, the 1 h pages stay
    assert len(kv.retention.expire()) == 1 and len(kv.retention) == 2
    clock.now += 3600.0
    assert len(kv.retention.expire()) == 2 and len(kv.retention) == 0
    kv.check_invariants()


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_a_1h_breakpoint_keeps_every_hit_through_5000_unrelated_requests(kind):
    """Issue 24's bar: a 1h cache entry (a span over the system prompt) read by every one of its requests while
    5,000 unrelated ones, 10 times the pool, churn everything else; its pages' TTL refreshed by each hit."""
    clock = FakeClock()
    kv = make_cache(kind, "lru", 64, clock)
    system = list(range(10_000, 10_000 + 4 * PAGE))
    spans = ((len(system), 3600.0),)
    serve(kv, make_request(system + [1], retention_spans=spans))
    hits = []
    for i in range(5000):
        clock.now += 1.0  # 5,000 s in all: past the first hour, so only the refreshes keep it
        serve(kv, make_request([100_000 + 7 * i + k for k in range(2 * PAGE)]))
        if i % 100 == 99:
            probe = make_request(system + [2 + i], retention_spans=spans)
            hits.append(kv.lookup(probe) == len(system))
            serve(kv, probe)
    kv.check_invariants()
    assert all(hits) and len(hits) == 50


def test_bad_retention_spans_are_value_errors():
    assert Retention(spans=None).spans == () and Retention(spans=[(8, 300)]).spans == ((8, 300.0),)  # type: ignore[arg-type]
    for spans in ([(0, 300)], [(8, 0)], [(8, float("nan"))], [(True, 5)], [(8,)], "8:300", [(8.0, 5)]):
        with pytest.raises(ValueError, match="retention_spans"):
            Retention(spans=spans)


def test_bad_retention_values_are_value_errors():
    for seconds in (-1.0, float("nan"), float("inf"), "10", True):
        with pytest.raises(ValueError, match="retention_seconds"):
            Retention(seconds)
    for priority in (1.5, "1", None, False):
        with pytest.raises(ValueError, match="retention_priority"):
            Retention(10.0, priority)
    assert Retention(0, 0).seconds is None and Retention(5, 2).seconds == 5.0
    with pytest.raises(ValueError, match="retained_pool_fraction"):
        RetentionTable(10, 1.5)


op = st.tuples(
    st.integers(0, 5),  # which shared prefix (0: none)
    st.integers(1, 6),  # own tokens after it, in pages
    st.sampled_from([None, None, 2.0, 5.0, 20.0]),  # retention_seconds
    st.integers(0, 2),  # retention_priority
    st.floats(0, 4),  # clock advance before it
    st.booleans(),  # keep it running until the next op
)


@pytest.mark.parametrize("kind,eviction", CASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=5, max_size=40))
def test_retention_never_starves_and_spares_retained_pages_first(kind, eviction, ops):
    clock = FakeClock()
    kv = make_cache(kind, eviction, 24, clock)
    released: set[int] = set()  # pages whose retention the cap ended during the current op (ordinary since)
    tell_cache = kv.retention.on_end

    def on_end(page: int) -> None:
        released.add(page)
        if tell_cache is not None:
            tell_cache(page)

    kv.retention.on_end = on_end
    held = None
    for n, (prefix, own, seconds, priority, advance, keep) in enumerate(ops):
        clock.now += advance
        tokens = [p * 1000 + k for p in [prefix] if prefix for k in range(2 * PAGE)]
        tokens += [(n + 1) * 100_000 + k for k in range(own * PAGE)]
        req = make_request(tokens, retention_seconds=seconds, retention_priority=priority)
        kv.retention.expire()
        released.clear()
        retained_before = set(kv.retention.pages()) & cached_pages(kv)
        num_free, unheld = unheld_pages(kv)
        cached = kv.lookup(req)
        need = kv.pages_needed(req, req.num_tokens - cached, cached) - cached // PAGE
        ok = admit(kv, req)
        if held is None:  # nothing else holds pages, so the pool can always make room: retention never refuses
            assert ok, "an allocation the pool could satisfy failed"
        if ok:
            evicted_retained = retained_before - cached_pages(kv) - released
            spare = num_free + len(unheld - retained_before)
            assert len(evicted_retained) <= max(0, need - spare), "a retained page went while others could"
            compute(kv, req)
        kv.check_invariants()
        assert len(kv.retention) <= kv.retention.capacity
        if held is not None:
            kv.free(held)
            held = None
        if ok and keep:
            held = req
        elif ok:
            kv.free(req)
        kv.check_invariants()
    if held is not None:
        kv.free(held)
    clock.now += 100.0  # every retention has ended: pages are ordinary, an allocation of the pool succeeds
    whole = make_request(list(range(7_000_000, 7_000_000 + kv.num_pages * PAGE - 1)))
    assert admit(kv, whole)
    assert len(kv.retention) == 0
    kv.check_invariants()


@pytest.mark.parametrize("kind,eviction", CASES)
def test_reset_drops_retained_pages_set_aside_by_eviction(kind, eviction):
    clock = FakeClock()
    kv = make_cache(kind, eviction, 16, clock)
    system = list(range(1000, 1000 + 2 * PAGE))
    serve(kv, make_request(system + [1], retention_seconds=10.0))
    for i in range(8):  # pressure: the retained pages are passed over (hash: parked) by eviction
        serve(kv, make_request([5000 + 20 * i + k for k in range(4 * PAGE)]))
    assert kv.lookup(make_request(system + [2])) == len(system)
    assert kv.reset_prefix_cache()
    assert len(kv.retention) == 0 and kv.lookup(make_request(system + [3])) == 0
    assert kv.num_free_pages() == kv.num_pages
    kv.check_invariants()
