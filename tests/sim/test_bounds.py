"""Hit-rate bounds: hand-computed cases, brute force over real token prompts, MIN >= LRU, the real trace."""

from __future__ import annotations

import random

import pytest

from prefixkv.sim.bounds import offline_hit_tokens, page_accesses, unbounded_hit_tokens
from prefixkv.sim.traces import BlockTokens, ScaledRequest, TraceScaling, load_trace, scale_trace
from tests.shared_data import MOONCAKE, shared_trace


def requests(specs, per_block=4) -> list[ScaledRequest]:
    """(block ids, prompt_len) pairs -> requests whose prompts are real token runs."""
    mapping = BlockTokens(per_block, max(max(ids) for ids, _ in specs), seed=1)
    return [ScaledRequest(0.0, 1, None, n, tuple(ids), per_block, mapping) for ids, n in specs]


def test_unbounded_by_hand():
    reqs = requests(
        [
            ((1, 2, 3), 12),  # nothing seen yet
            ((1, 2, 4), 12),  # blocks 1, 2 seen: 8 tokens
            ((1, 2, 3), 12),  # all seen, but the last token is computed: 2 pages of 4
            ((1, 2, 3), 10),  # 2 full pages seen, the partial third is no page
            ((5, 2, 3), 12),  # a different first block: block 2 after 5 is another prefix
            ((1,), 4),  # whole prompt seen; at most prompt_len - 1 tokens: 0 pages
        ]
    )
    b = unbounded_hit_tokens(reqs, 4)
    assert b.per_request == (0, 8, 8, 8, 0, 0)
    assert (b.hit_tokens, b.prompt_tokens) == (24, 62) and b.rate == 24 / 62
    # pages of 3 tokens over blocks of 4: a page spanning two blocks needs both
    b3 = unbounded_hit_tokens(reqs, 3)
    assert b3.per_request == (0, 6, 9, 9, 0, 3)


def token_pages(req: ScaledRequest, page_size: int) -> list[tuple[int, ...]]:
    """A request's full pages, each named by its whole token prefix: what a cache keyed by content sees."""
    tokens = req.prompt_tokens()
    return [tuple(tokens[: (j + 1) * page_size]) for j in range(len(tokens) // page_size)]


def simulate(reqs, page_size, capacity, victim):
    """The bounds' sequential model by brute force; `victim(cache, candidates, r)` picks the page to evict."""
    cache: dict[tuple[int, ...], int] = {}  # page -> last request that used it
    hits = []
    for r, req in enumerate(reqs):
        pages = token_pages(req, page_size)
        eligible = (req.prompt_len - 1) // page_size
        n = 0
        while n < eligible and pages[n] in cache:
            n += 1
        hits.append(n * page_size)
        pages = pages[:capacity]
        for page in pages:
            if page not in cache and len(cache) >= capacity:
                del cache[victim(cache, [p for p in cache if p not in pages], r)]
            cache[page] = r
    return hits


def lru(reqs, page_size, capacity):
    """Least recently used first, deeper first among pages last used by the same request."""
    return simulate(reqs, page_size, capacity, lambda cache, cands, r: min(cands, key=lambda p: (cache[p], -len(p))))


def belady(reqs, page_size, capacity):
    uses = [set(token_pages(q, page_size)[: (q.prompt_len - 1) // page_size]) for q in reqs]

    def next_use(page, r):
        return next((s for s in range(r + 1, len(reqs)) if page in uses[s]), len(reqs))

    return simulate(reqs, page_size, capacity, lambda c, cands, r: max(cands, key=lambda p: (next_use(p, r), len(p))))


def random_trace(seed: int, n: int = 25) -> list[ScaledRequest]:
    """Conversation-like: each request extends a leading run of an earlier one with new blocks."""
    rng = random.Random(seed)
    fresh = iter(range(1000))
    specs: list[tuple[tuple[int, ...], int]] = []
    for _ in range(n):
        base = rng.choice(specs)[0] if specs and rng.random() < 0.8 else ()
        ids = base[: rng.randint(0, len(base))] + tuple(next(fresh) for _ in range(rng.randint(1, 3)))
        specs.append((ids, 4 * len(ids) - rng.choice([0, 0, 1, 3])))
    return requests(specs)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [2, 3, 4])
def test_bounds_match_brute_force_and_beat_lru(seed, page_size):
    reqs = random_trace(seed)
    acc = page_accesses(reqs, page_size)
    unbounded = unbounded_hit_tokens(acc, page_size)
    assert list(unbounded.per_request) == simulate(reqs, page_size, 10**9, lambda cache, cands, r: cands[0])
    previous = 0
    for capacity in (3, 6, 12):
        bound = offline_hit_tokens(acc, page_size, capacity)
        assert list(bound.per_request) == belady(reqs, page_size, capacity)
        assert bound.hit_tokens >= sum(lru(reqs, page_size, capacity))
        assert unbounded.hit_tokens >= bound.hit_tokens >= previous  # MIN is a stack algorithm: monotone
        previous = bound.hit_tokens
    everything = offline_hit_tokens(acc, page_size, acc.num_pages)
    assert everything.per_request == unbounded.per_request and everything.evictions == 0


def test_offline_by_hand():
    # single-page prompts A B C A B C in a pool of 2: LRU misses every time; MIN keeps what returns soonest
    reqs = requests([((i,), 5) for i in (1, 2, 3, 1, 2, 3)])
    bound = offline_hit_tokens(reqs, 4, 2)
    assert bound.per_request == (0, 0, 0, 4, 0, 4) and bound.evictions == 2
    assert sum(lru(reqs, 4, 2)) == 0
    # a request longer than the pool caches its first pages only
    long = requests([((1, 2, 3), 12), ((1, 2, 3), 12)])
    assert offline_hit_tokens(long, 4, 1).per_request == (0, 4)
    with pytest.raises(ValueError, match="capacity_pages"):
        offline_hit_tokens(long, 4, 0)


def test_real_trace_unbounded_rate():
    """The README's fact (37.4% at 512-token blocks); the engine's rules (whole pages, one token left) give 37.34%."""
    trace = load_trace(str(shared_trace(MOONCAKE)))
    full = scale_trace(trace, TraceScaling())
    assert abs(unbounded_hit_tokens(full, 512).rate - 0.374) < 0.001
    head = scale_trace(trace, TraceScaling(tokens_per_block=16, max_requests=300))
    assert unbounded_hit_tokens(head, 16).per_request == tuple(
        simulate(head, 16, 10**9, lambda cache, cands, r: cands[0])
    )


@pytest.mark.parametrize("kind, page_size", [("hash", 4), ("hash", 3), ("radix", 4), ("radix", 1)])
def test_unbounded_equals_both_caches_with_a_big_pool(kind, page_size):
    """The bound's hit rule is the engine's: each request served alone, in order, on the real KV managers."""
    from prefixkv.kvcache.factory import create_kv_cache_manager
    from tests.kvcache.helpers import admit, compute, make_request

    reqs = random_trace(7, n=20)
    kv = create_kv_cache_manager(kind, 4096 // page_size, page_size)
    hits = []
    for spec in reqs:
        req = make_request(spec.prompt_tokens())
        hits.append(kv.lookup(req))
        assert admit(kv, req)
        compute(kv, req)
        kv.free(req)
    assert tuple(hits) == unbounded_hit_tokens(reqs, page_size).per_request
    kv.check_invariants()


def test_page_accesses_must_match_the_page_size():
    acc = page_accesses(random_trace(0, n=3), 4)
    with pytest.raises(ValueError, match="made for 4-token pages, not 2"):
        unbounded_hit_tokens(acc, 2)
