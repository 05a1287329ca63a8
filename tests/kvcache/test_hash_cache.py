import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv.engine.scheduler import admit_request
from prefixkv.kvcache.eviction import EVICTION_POLICIES
from prefixkv.kvcache.free_block_queue import Block, FreeBlockQueue
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.hashing import hash_prompt_blocks
from prefixkv.kvcache.no_cache import NoPrefixCache
from prefixkv.request import MultiModalHash
from tests.kvcache.helpers import admit, compute, make_request, run_to_completion


# -- free queue --------------------------------------------------------------------------------------------
def test_free_queue_lru_order_and_o1_removal_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # a prefix hit takes it from the middle through its own pointers
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]  # least recently used first
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    q.appendleft(blocks[0])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.remove(Block(99))


def test_free_queue_empty_pop_raises():
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()


def test_finished_request_frees_tail_first_and_eviction_drops_key():
    kv = HashPrefixCache(num_pages=8, page_size=4)
    req = make_request(range(17))  # 4 full blocks + 1 token
    run_to_completion(kv, req)
    table = list(kv.page_table(req))
    assert len(table) == 5 and len(kv.cached) == 4
    kv.free(req)
    order = [b.block_id for b in kv.free_queue]
    # the uncached partial block is reused first, then cached blocks tail first: chain ends go before beginnings
    tail_first = [table[4]] + [b for b in order if b not in table] + [table[3], table[2], table[1], table[0]]
    assert order[0] == table[4]
    assert order[-4:] == [table[3], table[2], table[1], table[0]]
    assert sorted(order) == sorted(tail_first)
    # fill the pool: the least recently used cached block (chain end, block 3) is evicted first, key and all
    keys = [kv.blocks[page].block_hash for page in table[:4]]
    other = make_request(range(100, 100 + 4 * 4 + 1))
    assert admit(kv, other)
    assert keys[3] not in kv.cached and all(key in kv.cached for key in keys[:3])
    assert kv.blocks[table[3]].block_hash != keys[3]  # (it carries other's key now: keyed at allocation)
    assert len(kv.cached) == 3 + 4  # other's 4 full blocks are findable from its allocation on (in flight)
    kv.check_invariants()


def test_hit_covers_full_blocks_only_and_never_the_last_token():
    kv = HashPrefixCache(num_pages=16, page_size=4)
    run_to_completion(kv, make_request(range(12)))
    kv.free(kv_req := make_request(range(12)))  # no-op free of an unknown request
    same = make_request(range(12))
    assert kv.lookup(same) == 8  # 12 tokens are 3 blocks, but the last token must be recomputed
    longer = make_request(list(range(12)) + [99, 98])
    assert kv.lookup(longer) == 12
    diverge = make_request(list(range(6)) + [77] * 6)
    assert kv.lookup(diverge) == 4  # stops at the first block that differs
    short = make_request(range(3))
    assert kv.lookup(short) == 0
    del kv_req


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue():
    kv = HashPrefixCache(num_pages=8, page_size=4)
    a = make_request(range(9))
    run_to_completion(kv, a)
    kv.free(a)
    free_before = kv.num_free_pages()
    b = make_request(list(range(8)) + [50, 51])
    assert admit(kv, b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    shared = [kv.blocks[i] for i in kv.page_table(b)[:2]]
    assert all(blk.ref_cnt == 1 and blk not in kv.free_queue for blk in shared)
    assert kv.num_free_pages() == free_before - 3
    assert kv.stats.queries == 9 + 10 and kv.stats.hits == 8
    kv.check_invariants()


def test_running_request_blocks_are_shared_before_it_finishes():
    kv = HashPrefixCache(num_pages=16, page_size=4)
    a = make_request(range(20))
    assert admit(kv, a, budget=8)  # chunked prefill: first 8 tokens
    compute(kv, a, 8)
    b = make_request(list(range(8)) + [1000])
    assert kv.lookup(b) == 8
    assert admit(kv, b)
    assert kv.blocks[kv.page_table(a)[0]].ref_cnt == 2
    kv.check_invariants()


def test_pages_keyed_in_flight_are_found_at_once_and_forgotten_if_never_computed():
    """A chunk's full blocks are findable from its allocation on (a later admission of the same step hits them);
    a request freed before its step ran (preempted in that step) takes back the keys of the blocks it had not
    computed, with BlockRemoved, and its retention of them: a lookup misses them, no page leaks."""
    from prefixkv.kvcache.events import BlockRemoved, BlockStored, apply_events

    kv = HashPrefixCache(num_pages=16, page_size=4)
    kv.enable_events()
    mirror: set[int] = set()
    a = make_request(range(20), retention_seconds=60.0)
    assert admit(kv, a, budget=8)
    compute(kv, a, 8)  # blocks 0, 1 computed
    assert kv.allocate(a, 9)  # the next chunk [8, 17): blocks 2, 3 keyed in flight
    follower = make_request(list(range(16)) + [99])
    assert kv.lookup(follower) == 16  # the in-flight blocks count
    stored = kv.drain_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored] and len(stored[1].block_hashes) == 2
    apply_events(mirror, stored)
    kv.check_invariants()
    kv.free(a)  # preempted before the step computed [8, 17)
    removed = kv.drain_events()
    assert all(isinstance(e, BlockRemoved) for e in removed) and len(removed) == 2
    apply_events(mirror, removed)
    assert mirror == kv.cached_block_hashes() and len(kv.cached) == 2
    assert kv.lookup(follower) == 8  # the computed blocks stay cached, the others are gone
    assert kv.num_free_pages() == kv.num_pages and kv.stats.evicted_pages == 0  # taking a key back evicts nothing
    kv.check_invariants()  # (retention of the forgotten blocks went with their keys)
    b = make_request(list(range(16)) + [7])
    assert admit(kv, b)  # a cache hit on in-flight pages, then commit of the hitter's own pages
    compute(kv, b)
    assert not kv._in_flight and kv.lookup(follower) == 16
    kv.check_invariants()


def test_generated_tokens_are_cached_too():
    kv = HashPrefixCache(num_pages=16, page_size=4)
    a = make_request(range(6))
    run_to_completion(kv, a)
    a.token_ids.extend([40, 41, 42])  # three decode steps
    for _ in range(3):
        assert kv.allocate(a, 1)
        compute(kv, a, 1)
    assert len(kv.cached) == 2  # tokens 0..7 form two full blocks
    b = make_request(list(range(6)) + [40, 41, 7])
    assert kv.lookup(b) == 8


def test_cache_salt_and_adapter_isolate_chains():
    kv = HashPrefixCache(num_pages=32, page_size=4)
    tokens = list(range(20))
    run_to_completion(kv, make_request(tokens))
    assert kv.lookup(make_request(tokens)) == 16
    assert kv.lookup(make_request(tokens, cache_salt="tenant-b")) == 0
    assert kv.lookup(make_request(tokens, lora_id="adapter-1")) == 0
    run_to_completion(kv, make_request(tokens, cache_salt="tenant-b"))
    assert kv.lookup(make_request(tokens, cache_salt="tenant-b")) == 16
    assert kv.lookup(make_request(tokens, cache_salt="tenant-c")) == 0


def test_multimodal_hashes_key_only_the_blocks_they_overlap():
    base = list(range(16))
    plain = hash_prompt_blocks(base, 4)
    image_a = hash_prompt_blocks(base, 4, mm_hashes=[MultiModalHash(5, 2, "aaaa")])
    image_b = hash_prompt_blocks(base, 4, mm_hashes=[MultiModalHash(5, 2, "bbbb")])
    assert image_a[0] == plain[0]  # block 0 lies before the image
    assert image_a[1] != plain[1] and image_a[1] != image_b[1]
    assert image_a[2] != plain[2]  # the chain carries the difference onwards
    salted = hash_prompt_blocks(base, 4, cache_salt="s")
    assert all(x != y for x, y in zip(salted, plain))


def test_reset_drops_unheld_blocks_and_says_whether_all_went():
    kv = HashPrefixCache(num_pages=16, page_size=4)
    a = make_request(range(9))
    run_to_completion(kv, a)
    b = make_request(range(50, 59))
    run_to_completion(kv, b)
    kv.free(a)
    assert kv.reset_prefix_cache() is False  # b still holds its cached blocks
    assert kv.lookup(make_request(range(9))) == 0
    assert kv.lookup(make_request(range(50, 60))) == 8
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert not kv.cached
    kv.check_invariants()


def test_allocation_failure_changes_nothing():
    kv = HashPrefixCache(num_pages=4, page_size=4)
    a = make_request(range(12))
    run_to_completion(kv, a)
    b = make_request(range(100, 120))
    before = (kv.num_free_pages(), dict(kv.cached))
    assert not admit(kv, b)
    assert (kv.num_free_pages(), dict(kv.cached)) == before
    assert b.num_computed_tokens == 0 and kv.page_table(b) == []
    kv.check_invariants()


def test_off_never_hits_and_keeps_exact_accounting():
    kv = NoPrefixCache(num_pages=8, page_size=4)
    a = make_request(range(9))
    run_to_completion(kv, a)
    kv.free(a)
    assert kv.lookup(make_request(range(9))) == 0 and not kv.cached
    assert kv.num_free_pages() == 8


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_two_processes_compute_the_same_keys(algo):
    tokens = list(range(1000, 1100))
    code = (
        "from prefixkv.kvcache.hashing import hash_prompt_blocks;"
        f"print(','.join(k.hex() for k in hash_prompt_blocks(list(range(1000, 1100)), 16, {algo!r}, "
        "lora_id='x', cache_salt='s')))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout.strip()
        for seed in (1, 2)
    }
    here = ",".join(k.hex() for k in hash_prompt_blocks(tokens, 16, algo, lora_id="x", cache_salt="s"))
    assert outs == {here}


# -- property-based: random add / step / finish / abort / preempt / reset on a small pool --------------------
class HashCacheMachine(RuleBasedStateMachine):
    @initialize(eviction=st.sampled_from(EVICTION_POLICIES))
    def setup(self, eviction):
        self.kv = HashPrefixCache(num_pages=12, page_size=4, eviction=eviction)
        self.running = []

    @rule(
        prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9)]),
        tail=st.lists(st.integers(0, 5), min_size=1, max_size=14),
        budget=st.integers(1, 16),
        salt=st.sampled_from([None, "a"]),
    )
    def add(self, prefix, tail, budget, salt):
        req = make_request(list(prefix) + tail, cache_salt=salt)
        cached = self.kv.lookup(req)
        assert cached % 4 == 0 and cached < req.num_tokens
        if admit_request(self.kv, req, min(req.num_tokens - cached, budget), cached):
            self.running.append(req)
        else:
            assert self.kv.page_table(req) == []

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), n=st.integers(1, 8), token=st.integers(0, 5))
    def step(self, i, n, token):
        req = self.running[i % len(self.running)]
        cap = len(self.kv.page_table(req)) * 4
        if req.num_computed_tokens < req.num_tokens:  # prefill chunk
            req.num_computed_tokens = min(req.num_tokens, cap)
            self.kv.commit(req)
            want = min(n, req.num_tokens - req.num_computed_tokens)
            if want and self.kv.allocate(req, want):
                pass
        else:  # decode one token
            req.token_ids.append(token)
            if self.kv.allocate(req, 1):
                req.num_computed_tokens += 1
                self.kv.commit(req)
            else:
                req.token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), preempt=st.booleans())
    def finish_or_preempt(self, i, preempt):
        req = self.running.pop(i % len(self.running))
        self.kv.free(req)
        if preempt:  # back to waiting with nothing computed; a re-admission must see its own blocks cached
            req.num_computed_tokens = 0
            cached = self.kv.lookup(req)
            if admit_request(self.kv, req, req.num_tokens - cached, cached):
                self.running.append(req)

    @rule()
    def reset(self):
        all_gone = self.kv.reset_prefix_cache()
        assert all_gone == (not self.kv.cached)
        held = {b.block_hash for b in self.kv.blocks if b.ref_cnt > 0}
        assert set(self.kv.cached) <= held

    @invariant()
    def accounting(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        kv = self.kv
        assert kv.free_queue.num_free + sum(1 for b in kv.blocks if b.ref_cnt > 0) == kv.num_pages

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in self.running:
            self.kv.free(req)
        assert self.kv.num_free_pages() == self.kv.num_pages


TestHashCacheMachine = HashCacheMachine.TestCase
TestHashCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
