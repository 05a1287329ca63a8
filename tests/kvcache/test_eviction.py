"""Eviction in both prefix caches: the evicted-page counter and the choice of policy."""

import argparse

import pytest

from prefixkv.bench import schedule_cost
from prefixkv.config import EngineConfig
from prefixkv.engine_args import add_engine_args, engine_config
from prefixkv.kvcache.eviction import EVICTION_POLICIES, make_eviction_policy
from prefixkv.kvcache.factory import create_kv_cache_manager
from tests.kvcache.helpers import make_request, run_to_completion


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_evicted_pages_counts_every_cached_page_dropped(kind):
    kv = create_kv_cache_manager(kind, 8, 4)
    first = make_request(range(17))  # 4 full pages cached, a partial fifth page private
    run_to_completion(kv, first)
    kv.free(first)
    assert kv.stats.evicted_pages == 0
    second = make_request(range(100, 125))  # 7 pages: the 4 uncached ones and 3 cached ones
    run_to_completion(kv, second)
    kv.check_invariants()
    assert kv.stats.evicted_pages == 3 and kv.summary().evicted_pages == 3
    assert kv.summary().details["eviction"] == "lru"
    kv.free(second)
    assert kv.reset_prefix_cache()
    assert kv.stats.evicted_pages == 3 + 1 + 6  # first's last cached page and second's 6, dropped by the reset
    kv.check_invariants()


def serve(kv, tokens) -> int:
    """One request start to finish; its cache hit in tokens."""
    req = make_request(tokens)
    run_to_completion(kv, req)
    kv.free(req)
    kv.check_invariants()
    return req.num_cached_tokens


@pytest.mark.parametrize("kind", ["hash", "radix"])
@pytest.mark.parametrize("eviction, kept", [("lru", False), ("lfu", True), ("cost", True)])
def test_a_hot_system_prompt_survives_a_scan_of_one_off_requests_except_under_lru(kind, eviction, kept):
    kv = create_kv_cache_manager(kind, 16, 4, eviction=eviction)
    system = list(range(100, 116))  # 4 pages, then hit by 3 more requests
    fresh = iter(range(1000, 2000))
    assert [serve(kv, system + [next(fresh) for _ in range(4)] + [0]) for _ in range(4)] == [0, 16, 16, 16]
    for _ in range(3):  # one-off prompts of 5 pages each, released after the system prompt was
        assert serve(kv, [next(fresh) for _ in range(20)] + [0]) == 0
    assert serve(kv, system + [1, 2, 3, 4, 0]) == (16 if kept else 0)
    assert kv.stats.evicted_pages == (9 if kept else 13)


@pytest.mark.parametrize("kind", ["hash", "radix"])
@pytest.mark.parametrize("eviction", ["lru", "lfu", "cost"])
def test_cost_aware_eviction_keeps_the_deep_prefix(kind, eviction):
    """A 40-token document, then an 8-token prompt, each used once; two pages must go. LRU and LFU (a tie, broken
    by age) take the document's tail; the cost policy takes the short prompt, cheaper to recompute."""
    kv = create_kv_cache_manager(kind, 16, 4, eviction=eviction)
    doc, short = list(range(100, 140)), list(range(200, 208))
    serve(kv, doc + [0])
    serve(kv, short + [0])
    serve(kv, list(range(300, 320)) + [0])
    assert kv.stats.evicted_pages == 2
    expected = (40, 0) if eviction == "cost" else (32, 8)
    assert (kv.lookup(make_request(doc + [1])), kv.lookup(make_request(short + [1]))) == expected


def test_eviction_policy_priorities():
    lru, lfu, cost = (make_eviction_policy(name) for name in EVICTION_POLICIES)
    assert lru.priority(0.0, 7, 3, 64, 16) == 7  # recency only
    assert lfu.priority(2.0, 7, 3, 64, 16) == 2.0 + 4  # age at release + uses
    shallow, deep = cost.priority(0.0, 7, 0, 0, 16), cost.priority(0.0, 7, 0, 4096, 16)
    assert 1 < shallow < deep and deep > 2  # a page 4096 tokens deep costs about twice as much
    assert cost.priority(0.0, 7, 1, 0, 16) == 2 * shallow  # twice the uses, twice the worth
    lfu.evicted(9.0)
    lfu.evicted(3.0)
    assert lfu.age == 9.0  # the age never goes back


def test_unknown_eviction_is_a_clear_error():
    with pytest.raises(ValueError, match="eviction must be one of"):
        create_kv_cache_manager("hash", 8, 4, eviction="mru")
    with pytest.raises(ValueError, match="eviction must be one of"):
        EngineConfig(eviction="mru")
    assert EngineConfig.from_kwargs(eviction="cost").eviction == "cost"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--eviction", "lfu"])).eviction == "lfu"
    assert engine_config(parser.parse_args([])).eviction == "lru"


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_schedule_cost_times_every_policy_under_constant_eviction(kind):
    cases = [schedule_cost.eviction_cost(kind, name, 64, 4, 64, 16, 0) for name in EVICTION_POLICIES]
    assert all(c["evicted_pages"] > 0 and c["alloc_free_us_per_evicted_page"] > 0 for c in cases)
    assert len({c["requests"] for c in cases}) == 1
