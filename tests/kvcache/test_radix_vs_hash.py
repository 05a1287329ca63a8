"""With no eviction pressure, a radix tree with 16-token pages and a hash chain with 16-token blocks are the same
index: every request of any workload sees the same hit. Both managers get the same admissions, chunks, decodes,
preemptions and frees, and must agree on every lookup and every admission's cached-token count. Under eviction
pressure they still agree, for every eviction policy, as long as no two requests compute the same page at once
(the radix tree returns such a duplicate page at commit, the hash cache keeps it private until free).

The hash cache here keys a block at commit, as the tree inserts (keys_in_flight_pages=False): keyed at allocation
(its default) it finds pages a step earlier, which the scheduler uses instead of deferring (test_duplicate_prefill
and test_hash_cache check that mode)."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv.engine.scheduler import admit_request
from prefixkv.kvcache.eviction import EVICTION_POLICIES
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from tests.kvcache.helpers import make_request

BASES = [list(range(100, 150)), list(range(100, 120)) + list(range(200, 230)), [7] * 40]


class SameHits(RuleBasedStateMachine):
    @initialize(eviction=st.sampled_from(EVICTION_POLICIES))
    def setup(self, eviction):
        self.hash = HashPrefixCache(4096, 16, eviction=eviction, keys_in_flight_pages=False)
        self.radix = RadixPrefixCache(4096, 16, eviction=eviction)
        self.waiting: list[tuple] = []
        self.running: list[tuple] = []

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 50),
        suffix=st.lists(st.integers(0, 2), max_size=25),
        salt=st.sampled_from([None, None, None, "t"]),
        copies=st.integers(1, 3),
    )
    def arrive(self, base, cut, suffix, salt, copies):
        tokens = base[:cut] + suffix or [1]
        for _ in range(copies):
            self.waiting.append((make_request(tokens, cache_salt=salt), make_request(tokens, cache_salt=salt)))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 20), chunk=st.integers(1, 40))
    def admit(self, i, chunk):
        pair = self.waiting.pop(i % len(self.waiting))
        for kv, req in zip((self.hash, self.radix), pair):
            cached = kv.lookup(req)
            assert admit_request(kv, req, min(chunk, req.num_tokens - cached), cached)
        assert pair[0].num_cached_tokens == pair[1].num_cached_tokens
        assert pair[0].num_computed_tokens == pair[1].num_computed_tokens
        self.running.append(pair)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20), k=st.integers(1, 40), token=st.integers(0, 2))
    def forward(self, i, k, token):
        """Compute up to k allocated tokens and commit; a fully computed sequence samples a token and asks for
        room for it (decode), an unfinished one for its next chunk."""
        pair = self.running[i % len(self.running)]
        for kv, req in zip((self.hash, self.radix), pair):
            cap = min(len(kv.page_table(req)) * kv.page_size, req.num_tokens)
            req.num_computed_tokens = min(req.num_computed_tokens + k, cap)
            kv.commit(req)
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(token)
            assert kv.allocate(req, min(k, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20))
    def prefill_all(self, i):
        pair = self.running[i % len(self.running)]
        for kv, req in zip((self.hash, self.radix), pair):
            assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
            req.num_computed_tokens = req.num_tokens
            kv.commit(req)
            req.token_ids.append(0)  # a computed sequence samples its next token, as in the engine

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 20), preempt=st.booleans())
    def release(self, i, preempt):
        pair = self.running.pop(i % len(self.running))
        for kv, req in zip((self.hash, self.radix), pair):
            kv.free(req)
            req.num_computed_tokens = 0
        if preempt:
            self.waiting.insert(0, pair)

    @invariant()
    def same_hits(self):
        if not hasattr(self, "hash"):
            return
        # waiting requests only: that is where the scheduler looks up (and the hash cache's per-request key memo
        # can run past num_tokens - 1 for a running request that computed its whole sequence)
        for h, r in self.waiting:
            assert self.hash.lookup(h) == self.radix.lookup(r), (h.token_ids, r.token_ids)
        assert self.hash.stats == self.radix.stats
        self.radix.check_invariants()
        self.hash.check_invariants()


SameHits.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSameHits = SameHits.TestCase


def test_same_hits_on_a_seeded_chat_workload():
    """System prompts ending off block boundaries, multi-turn follow-ups that extend earlier conversations,
    several requests in flight: every admission sees the same hit in both caches, and there are many hits."""
    import random

    rng = random.Random(0)
    systems = [[rng.randrange(50) for _ in range(n)] for n in (37, 50, 70)]
    convs: list[list[int]] = []
    caches = (HashPrefixCache(8192, 16, keys_in_flight_pages=False), RadixPrefixCache(8192, 16))
    in_flight: list[tuple] = []
    for _ in range(300):
        if convs and rng.random() < 0.5:
            base = rng.choice(convs)
        else:
            base = rng.choice(systems)
        tokens = base + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        pair = (make_request(tokens), make_request(tokens))
        for kv, req in zip(caches, pair):
            cached = kv.lookup(req)
            assert admit_request(kv, req, req.num_tokens - cached, cached)
        assert pair[0].num_cached_tokens == pair[1].num_cached_tokens
        in_flight.append(pair)
        if rng.random() < 0.7:  # finish a random in-flight request: prefill, decode a few tokens, free
            done = in_flight.pop(rng.randrange(len(in_flight)))
            out = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            for kv, req in zip(caches, done):
                for tok in out:
                    req.num_computed_tokens = req.num_tokens
                    kv.commit(req)
                    req.token_ids.append(tok)
                    assert kv.allocate(req, 1)
                kv.free(req)
            convs.append(done[0].token_ids)
    assert caches[0].stats == caches[1].stats and caches[0].stats.hit_rate > 0.3
    caches[1].check_invariants()


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_same_hits_and_evictions_under_pressure(eviction):
    """A pool of 60 four-token pages under a few hundred requests on shared prefixes: both caches evict the same
    pages in the same order (the radix tree a whole leaf where the hash cache takes its blocks one by one), so
    every admission's hit and the eviction count agree. Decoded tokens are unique, so no page is computed twice."""
    import random

    rng = random.Random(7)
    caches = (HashPrefixCache(60, 4, eviction=eviction), RadixPrefixCache(60, 4, eviction=eviction))
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(10, 120))] for _ in range(6)]
    running: list[tuple] = []
    for step in range(500):
        if rng.random() < 0.45:
            base = rng.choice(bases)
            tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
            pair = (make_request(tokens), make_request(tokens))
            admitted = []
            for kv, req in zip(caches, pair):
                cached = kv.lookup(req)
                admitted.append(admit_request(kv, req, req.num_tokens - cached, cached))
                if admitted[-1]:
                    req.num_computed_tokens = req.num_tokens
                    kv.commit(req)
            assert admitted[0] == admitted[1] and pair[0].num_cached_tokens == pair[1].num_cached_tokens
            if admitted[0]:
                running.append(pair)
        elif running:
            pair = running.pop(rng.randrange(len(running)))
            grown = []
            if rng.random() < 0.5:  # decode one token, else finish
                for kv, req in zip(caches, pair):
                    req.token_ids.append(10_000 + step)
                    grown.append(kv.allocate(req, 1))
                    if grown[-1]:
                        req.num_computed_tokens += 1
                        kv.commit(req)
                assert grown[0] == grown[1]
            if grown and grown[0]:
                running.append(pair)
            else:
                for kv, req in zip(caches, pair):
                    kv.free(req)
        assert caches[0].stats == caches[1].stats, step
        if step % 50 == 0:
            for kv in caches:
                kv.check_invariants()
    assert caches[0].stats.evicted_pages > 500 and caches[0].stats.hit_rate > 0.2
