"""A shared new prefix is computed once, under every policy: the real Scheduler driven without a model.

The hash cache keys a chunk's pages at allocation (keys_in_flight_pages), so a request admitted later in the same
step hits the pages an earlier chunk of the step computes: nobody waits, the order is the policy's. With the radix
cache (pages findable once computed), a waiting request whose first page not cached is completed in the same step
by a request already scheduled (running or admitted before it) waits one step and hits that page. Everything else
about the order is the policy's: FCFS stays FCFS apart from the deferred requests, which are first among the
waiting next step.
"""

from __future__ import annotations

import itertools

import pytest

from prefixkv.config import EngineConfig
from prefixkv.engine.scheduler import Scheduler
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.no_cache import NoPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.request import MultiModalHash, Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.sim.simulator import SimRequest, make_policy, simulate
from tests import kernels
from tests.kvcache.helpers import request_of

POLICIES = ["fcfs", "priority", "lpm", "dfs-weight", "bounded-lpm"]
S = list(range(1000, 1256))  # a 256-token shared prefix: 16 pages of 16
_ids = itertools.count()
_fresh = itertools.count(10_000_000)  # sampled tokens never collide with prompt tokens


def req(tokens, max_tokens=4, **kw) -> Request:
    r = request_of(f"q{next(_ids)}", tokens, SamplingParams(max_tokens=max_tokens), **kw)
    r.max_tokens = max_tokens
    return r


def own(n, tag):
    """n tokens of a request's own, distinct from every other request's from the first one."""
    return [100_000 + 1000 * tag + i for i in range(n)]


CACHES = {
    "radix1": lambda: RadixPrefixCache(8192, 1),
    "radix16": lambda: RadixPrefixCache(1024, 16),
    "hash16": lambda: HashPrefixCache(1024, 16),
}


@pytest.fixture(params=list(CACHES))
def kv(request):
    """A fresh cache of each kind (page size 1 and 16)."""
    return CACHES[request.param]()


def scheduler(kv, policy="fcfs", max_num_seqs=64, max_num_batched_tokens=2048) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, kv, make_policy(policy))


def step(sched: Scheduler) -> tuple[list[Request], int]:
    """One engine step without a model: returns the requests admitted this step, in admission order, and the
    tokens computed. Every chunk is computed; a request whose sequence it completes samples a fresh token and
    finishes after max_tokens of them (its pages are freed, as the engine does)."""
    was_running = set(map(id, sched.running))
    out = sched.schedule()
    admitted = [r for r, _ in out.scheduled if id(r) not in was_running]
    sampled = [next(_fresh) if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]
    sched.update(out, sampled)
    for (r, _), token in zip(out.scheduled, sampled, strict=True):
        if token is not None and r.num_output_tokens >= r.max_tokens:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
    sched.kv.check_invariants()
    assert not getattr(sched.kv, "_in_flight", None)  # after its step every page keyed in flight is computed
    return admitted, out.num_batched_tokens


def run_all(sched: Scheduler, max_steps=10_000) -> list[tuple[list[Request], int]]:
    steps = []
    while sched.has_work():
        assert len(steps) < max_steps
        steps.append(step(sched))
    assert sched.kv.num_free_pages() == sched.kv.num_pages  # no page leaks: everything finished gave back all
    assert not sched._hit_when_deferred  # nothing remembered for requests that are gone
    return steps


def names(reqs, label):
    return [label[id(r)] for r in reqs]


# -- the measured case: 32 x (1024 shared + 50), budget 2048 ------------------------------------------------------
@pytest.mark.parametrize(
    "kv_factory", [lambda: RadixPrefixCache(8192, 1), lambda: HashPrefixCache(512, 16)], ids=["radix1", "hash16"]
)
@pytest.mark.parametrize("policy", POLICIES)
def test_32_requests_behind_one_new_1024_prefix_hit_the_optimal_31_x_1024(policy, kv_factory):
    kv = kv_factory()
    prefix = list(range(50_000, 51_024))
    sched = scheduler(kv, policy, max_num_seqs=64, max_num_batched_tokens=2048)
    requests = [req(prefix + own(50, i), max_tokens=32) for i in range(32)]
    for r in requests:
        sched.add(r)
    steps = run_all(sched)
    assert kv.stats.hits == 31 * 1024  # only the first request computes the prefix
    assert [r.num_cached_tokens for r in requests].count(1024) == 31
    first, second = steps[0], steps[1]
    if kv.keys_in_flight_pages:  # the followers hit the pages the first one computes in this same step
        assert len(first[0]) == 21 and first[1] == 1074 + 19 * 50 + 24  # the budget: the 21st gets 24 tokens
        assert len(second[0]) == 11 and second[1] == 26 + 11 * 50 + 20  # the rest; 20 decodes
    else:  # the followers wait one step
        assert len(first[0]) == 1 and first[1] == 1074  # was 2048: request 2 computed 974 prefix tokens again
        assert len(second[0]) == 31 and second[1] == 31 * 50 + 1  # the rest, hitting; plus request 1's decode
    outputs = 32 * 31  # decodes after each request's prefill sampled its first token
    assert sum(n for _, n in steps) == 1024 + 32 * 50 + outputs  # the prefix computed once in all


@pytest.mark.parametrize("policy", POLICIES)
def test_with_same_step_keying_every_follower_is_scheduled_in_the_first_step(policy):
    """Budget for all: step 1 computes the prefix once and every follower's own 50 tokens, each follower reading
    the 1024 prefix tokens the first request writes in that step; one step fewer than with deferral."""
    prefix = list(range(50_000, 51_024))
    counts = {}
    for kv in (HashPrefixCache(512, 16), RadixPrefixCache(512, 16)):
        sched = scheduler(kv, policy, max_num_seqs=64, max_num_batched_tokens=4096)
        requests = [req(prefix + own(50, i), max_tokens=4) for i in range(32)]
        for r in requests:
            sched.add(r)
        steps = run_all(sched)
        assert kv.stats.hits == 31 * 1024 and sorted(r.num_cached_tokens for r in requests) == [0] + [1024] * 31
        counts[kv.name] = len(steps)
        if kv.keys_in_flight_pages:
            assert set(map(id, steps[0][0])) == set(map(id, requests)) and steps[0][1] == 1074 + 31 * 50
    assert counts == {"hash": 4, "radix": 5}


def test_the_simulator_runs_the_same_rule():
    prefix = list(range(30_000, 30_512))
    work = [SimRequest(0, prefix + [i, i + 1], 4, "g") for i in range(6)]
    for policy in POLICIES:
        kv = RadixPrefixCache(4096, 16)
        res = simulate(kv, make_policy(policy), work, max_num_seqs=8, max_num_batched_tokens=8192)
        kv.check_invariants()
        # (moved from test_cache_aware_policies, where lpm still computed the prefix six times in one batch)
        assert 512 <= res.computed_tokens < 2 * 512, policy


def test_without_a_prefix_cache_nothing_waits():
    kv = NoPrefixCache(1024, 16)
    sched = scheduler(kv, "fcfs", max_num_batched_tokens=4096)
    requests = [req(S + own(20, i)) for i in range(3)]
    for r in requests:
        sched.add(r)
    admitted, computed = step(sched)
    assert admitted == requests and computed == 3 * 276  # no hit next step could pay for a wait
    run_all(sched)


# -- FCFS order and fairness ------------------------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order_except_the_deferred_which_come_first_next_step(kv):
    """A and C, E share S (new); B, D, F share nothing. Plain FCFS (the same scheduler with no cache) admits
    A..F in one step; with the cache, C and E wait one step and are then the first admitted, before G, a
    later arrival."""
    label = {}
    spec = {
        "A": S + own(16, 1),
        "B": own(40, 2),
        "C": S + own(16, 3),
        "D": own(40, 4),
        "E": S + own(16, 5),
        "F": own(40, 6),
    }

    def add_all(sched):
        made = {name: req(tokens) for name, tokens in spec.items()}
        for name, r in made.items():
            label[id(r)] = name
            sched.add(r)
        return made

    plain = scheduler(NoPrefixCache(1024, 16), "fcfs")
    add_all(plain)
    assert names(step(plain)[0], label) == list("ABCDEF")

    sched = scheduler(kv, "fcfs")
    made = add_all(sched)
    late = req(own(40, 7))
    label[id(late)] = "G"
    if kv.keys_in_flight_pages:  # C and E hit the pages A computes in the same step: plain FCFS, S computed once
        admitted, computed = step(sched)
        assert names(admitted, label) == list("ABCDEF") and computed == 272 + 2 * 16 + 3 * 40
        sched.add(late)
        assert names(step(sched)[0], label) == ["G"]
    else:
        assert names(step(sched)[0], label) == list("ABDF")  # plain order minus the deferred ones
        assert names(sched.waiting, label) == list("CE")  # they keep their places
        sched.add(late)
        assert names(step(sched)[0], label) == list("CEG")
    assert made["C"].num_cached_tokens == made["E"].num_cached_tokens == len(S)
    run_all(sched)


def test_with_a_tight_budget_the_admission_order_is_plain_fcfs_order(kv):
    """Budget 512. Plain FCFS: A (272 tokens), then C's first 240 tokens; B, D, F next step. With the cache, C
    waits instead, holding the 240 tokens plain order gives it, so B, D, F get what they get without deferral;
    next step C (hitting S) is admitted first, then B, D, F: the same order, and S is computed once."""
    spec = {"A": S + own(16, 1), "C": S + own(16, 3), "B": own(100, 2), "D": own(100, 4), "F": own(100, 6)}

    def admissions(sched):
        label, made = {}, {}
        for name, tokens in spec.items():
            made[name] = r = req(tokens)
            label[id(r)] = name
            sched.add(r)
        steps = [names(admitted, label) for admitted, _ in run_all(sched)]
        return [names_ for names_ in steps if names_], made

    plain, _ = admissions(scheduler(NoPrefixCache(1024, 16), "fcfs", max_num_batched_tokens=512))
    assert plain == [["A", "C"], ["B", "D", "F"]]
    ours, made = admissions(scheduler(kv, "fcfs", max_num_batched_tokens=512))
    if kv.keys_in_flight_pages:  # C hits S in step 1 and needs only 16 tokens: all five fit one step
        assert ours == [["A", "C", "B", "D", "F"]]
    else:
        assert ours == [["A"], ["C", "B", "D", "F"]]
    assert sum(ours, []) == sum(plain, [])
    assert made["C"].num_cached_tokens == len(S)


def test_a_deferred_request_keeps_its_seat_and_priority_order_holds():
    """max_num_seqs 3, priority order high, mid-shared, low-shared, x, y. The shared ones wait for high's pages
    but hold their seats, so x and y do not take them (they would keep them for a whole generation)."""
    kv = RadixPrefixCache(2048, 16)
    label = {}

    def run(kv):
        sched = scheduler(kv, "priority", max_num_seqs=3)
        specs = [
            ("x", own(30, 4), 9),
            ("low-shared", S + own(16, 1), 5),
            ("high", S + own(16, 2), 0),
            ("mid-shared", S + own(16, 3), 1),
            ("y", own(30, 5), 9),
        ]
        for name, tokens, priority in specs:
            r = req(tokens, priority=priority)
            label[id(r)] = name
            sched.add(r)
        return [names(admitted, label) for admitted, _ in run_all(sched) if admitted]

    plain = run(NoPrefixCache(2048, 16))
    assert plain == [["high", "mid-shared", "low-shared"], ["x", "y"]]
    ours = run(kv)
    assert ours[:2] == [["high"], ["mid-shared", "low-shared"]]  # x and y got no seat in step 1
    assert sum(ours, []) == sum(plain, [])  # (x and y come as the seats free up: high finishes a step earlier)


# -- when a request waits, and when it does not -------------------------------------------------------------------
def test_a_request_follows_a_running_prefill_chunk_by_chunk(kv):
    """O's 700-token prompt is chunked (budget 256); R shares its first 600 tokens. Each step O's chunk
    completes R's next page, so R waits, and it is admitted once O has computed the shared part."""
    long = list(range(60_000, 60_700))
    sched = scheduler(kv, "fcfs", max_num_batched_tokens=256)
    o = req(long)
    sched.add(o)
    assert step(sched)[0] == [o]  # [0, 256)
    r = req(long[:600] + own(30, 1))
    sched.add(r)
    if kv.keys_in_flight_pages:  # O's pages are findable from their allocation on: R hits them in that step
        assert step(sched)[0] == []  # O's chunk [256, 512) takes the whole budget
        admitted, computed = step(sched)  # O computes [512, 700); R hits all of it it shares and computes the rest
        assert admitted == [r] and computed == 188 + 38 and r.num_cached_tokens == 600 - 600 % kv.page_size
        assert r.num_computed_tokens == 600 + 30  # a step before deferral would admit it
        run_all(sched)
        return
    assert step(sched)[0] == []  # O computes [256, 512): R's page [256, 272) among them; R waits
    admitted, _ = step(sched)  # O computes [512, 700); R (hit 512) would compute [512, 528) again: waits
    assert admitted == []
    admitted, _ = step(sched)
    assert admitted == [r] and r.num_computed_tokens == 600 + 30  # its hit covered all 600 shared tokens
    assert r.num_cached_tokens == 600 - 600 % kv.page_size
    run_all(sched)


def test_with_keys_in_flight_a_request_waits_for_the_page_a_chunk_ends_inside():
    """The pages this step completes are in a hit already when keyed in flight; the page a chunk stops inside (or
    right before) is computed by that request next step, so a follower sharing it waits rather than compute it
    twice. Without keys in flight the wait is for a page completed this step, as before."""
    from prefixkv.engine.scheduler import _PagesComputedThisStep

    shared = list(range(70_000, 70_100))
    o, r = req(shared + own(20, 1)), req(shared + own(20, 2))
    o.num_computed_tokens = 32
    keyed = _PagesComputedThisStep(16, [(o, 40)], keyed_in_flight=True)  # O computes [32, 72): ends inside [64, 80)
    assert keyed.computes_next(r, 64) and not keyed.computes_next(r, 48) and not keyed.computes_next(r, 80)
    assert _PagesComputedThisStep(16, [(o, 48)], keyed_in_flight=True).computes_next(r, 80)  # ends at its start
    plain = _PagesComputedThisStep(16, [(o, 40)])
    assert plain.computes_next(r, 48) and not plain.computes_next(r, 64)
    assert not keyed.computes_next(req(list(range(90_000, 90_120))), 64)  # other tokens: nothing to wait for


@pytest.mark.parametrize("kv", ["radix16", "hash16"], indirect=True)  # with 1-token pages no page is half done
def test_no_wait_for_a_page_the_other_request_does_not_complete_this_step(kv):
    """With S cached: O's prompt ends 8 tokens into the page after S, and R shares those 8 tokens: O does not
    complete R's page, so R computes it now. Then a decode: R2 continues O's whole sequence, and O's decode
    computes one token of R2's page, not through its end."""
    warm = req(S + [1])
    warm_sched = scheduler(kv)
    warm_sched.add(warm)
    run_all(warm_sched)
    x = own(8, 1)
    sched = scheduler(kv, "fcfs")
    o, r = req(S + x, max_tokens=8), req(S + x + own(30, 2))
    sched.add(o)
    sched.add(r)
    assert step(sched)[0] == [o, r]
    r2 = req(o.token_ids + own(30, 3))
    sched.add(r2)
    assert step(sched)[0] == [r2]  # O decodes position 264 only; R2's first new page is [256, 272)
    run_all(sched)


def test_salts_adapters_and_multimodal_inputs_keep_requests_apart(kv):
    base = S + own(16, 1)
    cat, dog = MultiModalHash(0, 8, "cat"), MultiModalHash(0, 8, "dog")  # inside the first page
    cases = [
        (dict(cache_salt="t1"), dict(cache_salt="t2"), False),
        (dict(cache_salt="t1"), dict(cache_salt="t1"), True),
        (dict(lora_id="a"), dict(lora_id="b"), False),
        (dict(lora_id="a"), dict(), False),
        (dict(mm_hashes=(cat,)), dict(mm_hashes=(dog,)), False),
        (dict(mm_hashes=(cat,)), dict(mm_hashes=(cat,)), True),
        (dict(mm_hashes=(MultiModalHash(300, 8, "cat"),)), dict(), True),  # after the first page: not there yet
    ]
    for first_kw, second_kw, waits in cases:
        kv.reset_prefix_cache()
        sched = scheduler(kv)
        first, second = req(base, **first_kw), req(S + own(16, 2), **second_kw)
        sched.add(first)
        sched.add(second)
        if kv.keys_in_flight_pages:  # no wait: the second hits the first's pages in the same step, or misses them
            assert step(sched)[0] == [first, second]
            assert second.num_cached_tokens == (len(S) if waits else 0), (first_kw, second_kw)
        else:
            assert step(sched)[0] == ([first] if waits else [first, second]), (first_kw, second_kw)
        run_all(sched)


def test_the_old_bounded_lpm_deferral_cases_under_the_scheduler():
    """test_cache_aware_policies' should_defer cases, asked of the scheduler (the rule's one owner now)."""
    P = list(range(1000, 1064))  # 4 pages of 16

    def second_waits(first_tokens, second, policy="bounded-lpm", kv=None):
        kv = kv or RadixPrefixCache(512, 16)
        sched = scheduler(kv, policy)
        first = req(first_tokens)
        sched.add(first)
        sched.add(second)
        admitted = step(sched)[0]
        run_all(sched)
        return second not in admitted

    alone = scheduler(RadixPrefixCache(512, 16), "bounded-lpm")
    b = req(P + [4, 5, 6])
    alone.add(b)
    assert step(alone)[0] == [b]  # nobody else computes its pages
    assert second_waits(P + [1, 2, 3], req(P + [4, 5, 6]))
    assert not second_waits(P[:15] + [0] * 20, req(P + [4, 5, 6]))  # shares less than a page
    assert not second_waits(P + [1, 2, 3], req(P + [4], cache_salt="x"))  # other tenant
    kv = RadixPrefixCache(512, 16)
    warm = scheduler(kv)
    warm.add(req(P + [9]))
    run_all(warm)
    assert not second_waits(P + [1, 2, 3], req(P + [4, 5, 6]), kv=kv)  # everything shared is cached already
    overdue = req(P + [4, 5, 6])
    overdue.arrival_step = -20  # the policy's old exemption is gone: the wait is one step per page, not unbounded
    assert second_waits(P + [1, 2, 3], overdue)
    assert second_waits(P + [1, 2, 3], req(P + [4, 5, 6]), policy="lpm")  # now every policy


def test_a_request_is_never_deferred_twice_at_the_same_hit():
    """The bound on deferral: if the page it waited for is gone before it could hit it (here the cache is reset
    between the steps) and another request computes it again, the request does not wait a second time."""
    kv = RadixPrefixCache(512, 16)
    sched = scheduler(kv, "priority")
    first, patient = req(S + own(16, 1), max_tokens=1, priority=0), req(S + own(16, 2), priority=5)
    sched.add(first)
    sched.add(patient)
    assert step(sched)[0] == [first]  # first finishes at once, its pages stay cached
    assert kv.reset_prefix_cache()
    again = req(S + own(16, 3), priority=0)
    sched.add(again)
    assert step(sched)[0] == [again, patient]  # hit 0 again: deferring once more could repeat forever
    run_all(sched)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "kv_factory", [lambda: RadixPrefixCache(48, 16), lambda: HashPrefixCache(48, 16)], ids=["radix16", "hash16"]
)
def test_under_memory_pressure_with_preemption_every_request_finishes_and_no_page_leaks(policy, kv_factory):
    """Groups sharing prefixes, a pool of 48 pages (768 tokens), chunked prefill, staggered arrivals: the rule
    meets preemption and eviction; every request finishes, the accounting holds after each step."""
    kv = kv_factory()
    sched = scheduler(kv, policy, max_num_seqs=8, max_num_batched_tokens=192)
    prefixes = [list(range(70_000 + 1000 * g, 70_000 + 1000 * g + 200)) for g in range(3)]
    pending = [req(prefixes[i % 3] + own(10 + i, i), max_tokens=24) for i in range(24)]
    done = 0
    for n in itertools.count():
        assert n < 5000
        if pending and n % 2 == 0:
            sched.add(pending.pop(0))
        step(sched)
        if not pending and not sched.has_work():
            break
        done = n
    assert done > 0 and sched.num_preemptions > 0  # the pool was really short
    assert kv.num_free_pages() == kv.num_pages and not sched._hit_when_deferred


def test_a_request_preempted_in_the_step_that_keyed_its_pages_takes_the_keys_back():
    """Priority policy, a 4-page pool (pages of 4): low-priority A runs first; in step 3 its decode token
    completes its page 1, keyed at allocation, then high-priority B's chunk finds no page and preempts A. A's
    page 1 was never computed: it is no longer findable (BlockRemoved), page 0 (computed) still is."""
    from prefixkv.kvcache.events import BlockRemoved, apply_events

    kv = HashPrefixCache(4, 4)
    kv.enable_events()
    mirror: set[int] = set()
    sched = scheduler(kv, "priority", max_num_batched_tokens=8)
    a, b = req(own(6, 1), max_tokens=8, priority=9), req(own(12, 2), priority=0)
    sched.add(a)
    step(sched)  # A's prompt: page 0 computed
    sched.add(b)
    assert step(sched)[0] == [b]  # A decodes position 6, B's first 7 tokens
    apply_events(mirror, kv.drain_events())
    out = sched.schedule()  # A's decode at position 7 completes its page 1: keyed in flight; B preempts A
    assert out.preempted == [a] and [r for r, _ in out.scheduled] == [b]
    events = kv.drain_events()  # A's page 1 stored and removed, then B's new pages stored
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 1 and removed[0] not in kv.cached_block_hashes()
    assert kv.stats.evicted_pages == 0  # taken back, not evicted: B got that uncached page first
    apply_events(mirror, events)
    assert mirror == kv.cached_block_hashes()
    assert kv.lookup(req(a.token_ids[:8] + [5])) == 4  # page 0 only
    kv.check_invariants()
    sched.update(out, [None] * len(out.scheduled))
    run_all(sched)  # A comes back and finishes; no page leaks


# -- through the real model --------------------------------------------------------------------------------------
_ALONE: list[list[int]] = []  # filled by the first parametrization below


@pytest.mark.parametrize(
    "options",
    [
        dict(prefix_cache="hash"),
        dict(prefix_cache="radix", page_size=16, max_num_batched_tokens=64, schedule_policy="lpm"),
    ],
    ids=["hash-fcfs", "radix16-chunked-lpm"],
)
def test_outputs_with_deferral_equal_each_prompt_run_alone(new_llm, options):
    """fp32 greedy: a batch in which requests share each other's new pages gives every prompt the tokens it gets
    alone on a cold cache, and the sharing paid. Hash: the followers read, in the same forward pass, the pages the
    first request writes (keyed in flight); radix, chunked: they wait for each other's pages (admitted together,
    or behind a running chunked prefill)."""
    import random

    rng = random.Random(14)
    words = lambda n: [rng.randrange(200, 40000) for _ in range(n)]  # noqa: E731
    shared = words(150)
    prompts = [shared + words(5 + 4 * i) for i in range(5)]
    long = shared + words(200)
    prompts += [long, long[:300] + words(12)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    llm = new_llm(kv_cache_tokens=4096, debug_nan_kv=True, **options)

    def generate(batch):
        return llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)

    llm.reset_prefix_cache()
    batched = generate(prompts)
    if not _ALONE:  # each prompt alone on a cold cache: the model's own greedy tokens, whatever the engine options
        for p in prompts:
            assert llm.reset_prefix_cache()
            _ALONE.append(generate([p])[0].outputs[0].token_ids)
    alone = _ALONE
    assert [o.outputs[0].token_ids for o in batched] == alone
    page_floor = 150 - 150 % 16
    assert all(o.num_cached_tokens >= page_floor for o in batched[1:5])  # they waited for the first's pages
    assert batched[6].num_cached_tokens >= 288  # it followed the long prompt's chunks (300 shared, pages of 16)
    assert llm.llm_engine.get_stats().num_pages_used == 0


# Without the native kernels (a CPU without AVX2) bf16 runs torch's paths, which the fp32 tests above cover, and
# torch emulates bf16 products at a fifth of its fp32 rate (measured on AMD EPYC Zen 3): 12 s for nothing new.
@kernels.NATIVE_ATTENTION
def test_bf16_same_step_reads_match_deferred_reads(new_llm):
    """bf16, whose native kernels (shared-prefix prefill) the fp32 test does not reach: the followers that read, in
    the same forward pass, the shared pages the first request writes there produce the same greedy tokens as when
    they wait a step and read those pages computed (keys_in_flight_pages off), or part only at a near-tie (top-2
    logprob gap within two bf16 steps at the first differing token)."""
    import random

    rng = random.Random(15)
    shared = [rng.randrange(200, 40000) for _ in range(150)]
    prompts = [shared + [rng.randrange(200, 40000) for _ in range(6 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    llm = new_llm(dtype="bfloat16", kv_cache_tokens=4096, prefix_cache="hash", debug_nan_kv=True)
    engine = llm.llm_engine
    runs, steps = {}, {}
    for same_step in (True, False):
        assert llm.reset_prefix_cache()
        engine.kv.keys_in_flight_pages = same_step  # the scheduler reads it each step (off: it defers)
        first_step = engine.scheduler.step_count
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        steps[same_step] = engine.scheduler.step_count - first_step
        assert all(o.num_cached_tokens == 144 for o in outs[1:])
        runs[same_step] = [o.outputs[0] for o in outs]
    engine.kv.keys_in_flight_pages = True
    assert steps[True] == steps[False] - 1  # all five prefills in step 1 (here one shared-prefix group)
    assert engine.get_stats().num_pages_used == 0
    for same, deferred in zip(runs[True], runs[False], strict=True):
        if same.token_ids == deferred.token_ids:
            continue
        j = next(j for j, (a, b) in enumerate(zip(same.token_ids, deferred.token_ids, strict=True)) if a != b)
        top = same.logprobs[j].top_logprobs
        assert top[0][1] - top[1][1] <= 0.25, (j, top)  # a near-tie, not a wrong read
