"""The pages a cache reports invalid (what debug_nan_kv fills with NaN) are every page it hands to a new owner,
evicts or frees uncached, and never a page someone may still read.

A model of the pool: each page holds zeros at first, then the (position, token) pairs last written into it, or
INVALID once the cache reported it. A random workload of admissions, chunked computes, frees and resets runs on
each cache; a hit must read exactly what its tokens say (so a page reported invalid while a hit could still find
it fails here), and every page a request newly gets must be INVALID at that moment (reported when handed out).
"""

from __future__ import annotations

import random

import pytest

from prefixkv.kvcache.factory import create_kv_cache_manager
from tests.kvcache.helpers import admit, make_request

INVALID, ZERO = "invalid", "zero"  # a fresh pool reads zeros (pool_memory.lazily_zeroed), plausible KV


class Pool:
    def __init__(self, kv) -> None:
        self.kv = kv
        self.pages: dict[int, object] = dict.fromkeys(range(kv.num_pages), ZERO)
        self.reported = 0
        kv.watch_invalid_pages(self.invalidate)

    def invalidate(self, pages: list[int]) -> None:
        self.reported += len(pages)
        for p in pages:
            assert 0 <= p < self.kv.num_pages
            self.pages[p] = INVALID

    def write(self, req, start: int, end: int) -> None:
        """A forward pass writing positions [start, end) of req into its pages."""
        table, ps = self.kv.page_table(req), self.kv.page_size
        for pos in range(start, end):
            page = table[pos // ps]
            held = self.pages.get(page)
            content = dict(held) if isinstance(held, dict) else {}
            content[pos % ps] = (pos, req.token_ids[pos])
            self.pages[page] = content

    def check_reads(self, req, hit: int) -> None:
        """Positions [0, hit) that req took from the cache hold what its tokens say."""
        table, ps = self.kv.page_table(req), self.kv.page_size
        for pos in range(hit):
            content = self.pages[table[pos // ps]]
            assert isinstance(content, dict), f"hit page {table[pos // ps]} holds {content!r}"
            assert content.get(pos % ps) == (pos, req.token_ids[pos]), f"position {pos} of a hit reads stale KV"


@pytest.mark.parametrize("kind, page_size", [("hash", 4), ("radix", 1), ("radix", 4), ("off", 4)])
def test_every_fresh_page_was_reported_and_no_readable_one(kind, page_size):
    rng = random.Random(7)
    kv = create_kv_cache_manager(kind, 24, page_size)
    pool = Pool(kv)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    running: list = []

    def step(req, n: int, first: bool) -> bool:
        """Allocate (admit) n more tokens of req, check its new pages were reported, write and commit them."""
        old = len(kv.page_table(req))
        hit = kv.lookup(req) if first else 0
        if not (admit(kv, req, budget=n) if first else kv.allocate(req, n)):
            return False
        pool.check_reads(req, hit)
        table = kv.page_table(req)
        for page in table[max(old, hit // page_size) :]:  # handed out anew: reported, NaN until written
            assert pool.pages[page] == INVALID, f"page {page} handed out unreported"
        start = req.num_computed_tokens
        n = min(n, req.num_tokens - start)
        pool.write(req, start, start + n)
        req.num_computed_tokens = start + n
        kv.commit(req)
        return True

    for _ in range(400):
        action = rng.random()
        if action < 0.45 or not running:
            tokens = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            req = make_request(tokens)
            if step(req, rng.randrange(1, 12), first=True):
                running.append(req)
        elif action < 0.75:
            req = rng.choice(running)
            if req.num_computed_tokens < req.num_tokens:
                step(req, rng.randrange(1, 6), first=False)
        elif action < 0.97:
            kv.free(running.pop(rng.randrange(len(running))))
        else:
            kv.reset_prefix_cache()
    assert pool.reported > 0
