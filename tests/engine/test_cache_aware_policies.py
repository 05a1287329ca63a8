import argparse
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.bench.thrash import pool_pages
from prefixkv.config import EngineConfig
from prefixkv.engine.cache_aware_policies import BoundedLPMPolicy, DFSWeightPolicy, KLPMPolicy, LPMPolicy, create
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine_args import add_engine_args, engine_config
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.sim.simulator import SimRequest, make_policy, simulate
from tests.kvcache.helpers import make_request, run_to_completion

P = list(range(1000, 1064))  # 64 tokens: 4 pages of 16
Q = list(range(2000, 2096))  # 96 tokens


def warm(kv, *prompts):
    for tokens in prompts:
        req = make_request(tokens)
        run_to_completion(kv, req)
        kv.free(req)


def caches():
    return [RadixPrefixCache(512, 1), RadixPrefixCache(512, 16), HashPrefixCache(512, 16)]


def ids(reqs):
    return [r.request_id for r in reqs]


def test_create_maps_names():
    assert isinstance(create(EngineConfig(schedule_policy="lpm")), LPMPolicy)
    assert isinstance(create(EngineConfig(schedule_policy="dfs-weight")), DFSWeightPolicy)
    bounded = create_policy(EngineConfig(schedule_policy="bounded-lpm", max_wait_steps=7, lpm_fallback_threshold=None))
    assert isinstance(bounded, BoundedLPMPolicy) and bounded.max_wait_steps == 7
    assert bounded.fallback_threshold is None
    k_lpm = create_policy(EngineConfig(schedule_policy="k-lpm", lpm_k=3))
    assert isinstance(k_lpm, KLPMPolicy) and k_lpm.k == 3 and k_lpm.fallback_threshold == 128
    assert create(EngineConfig(schedule_policy="k-lpm")).k == 4
    with pytest.raises(ValueError):
        create(EngineConfig(schedule_policy="fcfs"))
    with pytest.raises(ValueError, match="lpm_k"):
        EngineConfig(schedule_policy="k-lpm", lpm_k=0)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(["--schedule-policy", "k-lpm", "--lpm-k", "2"]))
    assert config.schedule_policy == "k-lpm" and config.lpm_k == 2


@pytest.mark.parametrize("kv", caches(), ids=lambda kv: f"{kv.name}{kv.page_size}")
def test_lpm_orders_longest_hit_first_ties_by_queue_order(kv):
    warm(kv, P + [1] * 40)
    miss = make_request(Q + [5])
    short = make_request(P[:32] + [7] * 8)
    long1 = make_request(P + [1] * 20 + [9])
    long2 = make_request(P + [1] * 20 + [8])
    waiting = [miss, short, long1, long2]
    assert ids(LPMPolicy().order(waiting, kv, 0)) == ids([long1, long2, short, miss])
    assert LPMPolicy(fallback_threshold=3).order(waiting, kv, 0) == waiting  # past the threshold: FCFS


@pytest.mark.parametrize("kv", caches(), ids=lambda kv: f"{kv.name}{kv.page_size}")
def test_dfs_weight_takes_heavier_subtrees_first(kv):
    warm(kv, P + [1] * 40, Q + [2] * 40)
    q_long = make_request(Q + [2] * 32 + [0])  # the longest single hit
    p_reqs = [make_request(P + [3, i]) for i in range(3)]  # three requests below P
    p_deep = make_request(P + [1] * 32 + [4])  # below P, deeper
    miss = make_request([9] * 40)
    waiting = [miss, q_long, p_reqs[0], p_reqs[1], p_deep, p_reqs[2]]
    order = ids(DFSWeightPolicy().order(waiting, kv, 0))
    # P's subtree has 4 waiting requests, Q's 1: P first, its deeper hit before the rest; misses last
    assert order == ids([p_deep] + p_reqs + [q_long, miss])
    assert ids(LPMPolicy().order(waiting, kv, 0))[0] == q_long.request_id


def test_dfs_weight_without_hits_is_queue_order():
    kv = RadixPrefixCache(64, 1)
    waiting = [make_request([i, i]) for i in range(5)]
    assert DFSWeightPolicy().order(waiting, kv, 3) == waiting


def test_bounded_lpm_never_lets_newcomers_pass_a_request_older_than_the_bound():
    kv = RadixPrefixCache(512, 1)
    warm(kv, P + [1])
    cold = make_request(Q + [0])
    cold.arrival_step = 0
    hot = []
    for s in (3, 8, 20, 25):
        r = make_request(P + [s, s])
        r.arrival_step = s
        hot.append(r)
    policy = BoundedLPMPolicy(max_wait_steps=10)
    # hot requests that arrived within 10 steps of the cold one may pass it; later ones may not
    assert ids(policy.order([cold] + hot, kv, 25)) == ids([hot[0], hot[1], cold, hot[2], hot[3]])
    # everyone within the bound of each other: plain LPM
    assert ids(policy.order([cold] + hot[:2], kv, 9)) == ids(hot[:2] + [cold])
    assert ids(BoundedLPMPolicy(max_wait_steps=100).order([cold] + hot, kv, 25)) == ids(hot + [cold])


@pytest.mark.parametrize("kv", caches(), ids=lambda kv: f"{kv.name}{kv.page_size}")
def test_k_lpm_takes_the_oldest_then_k_minus_1_longest_hits(kv):
    warm(kv, P + [1] * 40)
    cold = [make_request(Q + [i]) for i in range(3)]
    short = make_request(P[:32] + [7] * 8)
    mid = make_request(P + [6] * 8)
    long1 = make_request(P + [1] * 20 + [9])
    long2 = make_request(P + [1] * 20 + [8])
    waiting = [cold[0], short, cold[1], long1, long2, cold[2], mid]
    # groups of 3: [oldest, 2 longest hits] x 2, then the last one
    assert ids(KLPMPolicy(3).order(waiting, kv, 0)) == ids([cold[0], long1, long2, short, mid, cold[1], cold[2]])
    assert KLPMPolicy(1).order(waiting, kv, 0) == waiting  # k=1: FCFS
    assert ids(KLPMPolicy(100).order(waiting, kv, 0)) == ids([cold[0]] + LPMPolicy().order(waiting[1:], kv, 0))
    assert KLPMPolicy(3, fallback_threshold=6).order(waiting, kv, 0) == waiting


def _k_lpm_queue():
    kv = RadixPrefixCache(512, 1)
    warm(kv, P + [1] * 40, Q + [2] * 40)
    return kv


@settings(max_examples=30, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["cold", "p8", "p64", "p100", "q50"]), min_size=1, max_size=24),
    k=st.integers(1, 6),
)
def test_k_lpm_groups_and_starvation_bound(kinds, k):
    """Every group of k is the oldest request left, then the k-1 longest hits left (ties: queue order). So the
    request with p requests ahead of it in the queue is placed within the first p+1 groups, whatever the hits
    (the oldest is always first), and the queue is placed in ceil(n/k) groups."""
    kv = _k_lpm_queue()
    prefix = {"cold": [], "p8": P[:8], "p64": P, "p100": P + [1] * 36, "q50": Q[:50]}
    waiting = [make_request(prefix[kind] + [-1, i]) for i, kind in enumerate(kinds)]
    hit = {r.request_id: kv.lookup(r) for r in waiting}
    position = {r.request_id: i for i, r in enumerate(waiting)}
    order = KLPMPolicy(k).order(waiting, kv, 0)
    assert sorted(ids(order)) == sorted(ids(waiting))
    assert order[0] is waiting[0]
    left = list(waiting)
    for g in range(math.ceil(len(waiting) / k)):
        group = order[g * k : (g + 1) * k]
        assert group[0] is left[0]
        left.remove(group[0])
        rest = sorted(left, key=lambda r: -hit[r.request_id])[: k - 1]
        assert ids(group[1:]) == ids(rest)
        for r in group[1:]:
            left.remove(r)
    for at, r in enumerate(order):
        assert at // k <= position[r.request_id]


# (the deferral of duplicate prefills is the scheduler's now, for every policy: tests/engine/test_duplicate_prefill.py)


# -- with the real scheduler, driven without a model ------------------------------------------------------------
def hot_stream_and_one_cold(steps=400):
    hot_prefix, cold_prefix = list(range(10_000, 10_256)), list(range(20_000, 20_256))
    work = [SimRequest(s, hot_prefix + [s, s + 1, s + 2], 8, "hot") for s in range(0, steps, 2)]
    work.append(SimRequest(5, cold_prefix + [1, 2, 3], 8, "cold"))
    return work


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_lpm_starves_a_cold_request_and_bounded_lpm_and_k_lpm_admit_it(cache):
    def run(policy):
        kv = (RadixPrefixCache if cache == "radix" else HashPrefixCache)(pool_pages(256, 3, 8, 8, 16), 16)
        res = simulate(
            kv,
            make_policy(policy, max_wait_steps=20),
            hot_stream_and_one_cold(),
            max_num_seqs=8,
            max_num_batched_tokens=512,
            check_every=7,
        )
        kv.check_invariants()
        cold = next(r for r in res.requests if res.groups[r.request_id] == "cold")
        return res, res.wait_steps[cold.request_id]

    lpm, lpm_wait = run("lpm")
    bounded, bounded_wait = run("bounded-lpm")
    assert lpm_wait > 350  # passed over as long as hot requests keep coming
    assert bounded_wait <= 20 + 20  # the bound, plus the running hot requests draining (8 output tokens each)
    hot_hits = [sum(r.num_cached_tokens for r in res.requests) for res in (lpm, bounded)]
    assert hot_hits[1] >= 0.95 * hot_hits[0]  # the detour costs about two prefix misses
    k_lpm, k_lpm_wait = run("k-lpm")
    assert k_lpm_wait <= 20  # oldest once the three hot requests before it are in: admitted at the next free seat
    assert sum(r.num_cached_tokens for r in k_lpm.requests) >= 0.95 * hot_hits[0]
