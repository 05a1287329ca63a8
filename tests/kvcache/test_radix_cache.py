import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv.engine.scheduler import admit_request
from prefixkv.kvcache.eviction import EVICTION_POLICIES
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.kvcache.radix_tree import RadixTree, common_prefix_len
from prefixkv.kvcache.summary import HotPrefix
from prefixkv.request import MultiModalHash
from tests.kvcache.helpers import admit, compute, make_request, run_to_completion


def cached_then_freed(kv, tokens, **kw):
    req = make_request(tokens, **kw)
    run_to_completion(kv, req)
    kv.free(req)
    kv.check_invariants()
    return req


def test_factory_builds_radix():
    kv = create_kv_cache_manager("radix", 8, 1)
    assert isinstance(kv, RadixPrefixCache) and kv.name == "radix"


def test_common_prefix_len_long_runs():
    run = list(range(300))
    assert common_prefix_len(run, run, 0, 300) == 300
    other = run[:200] + [-1] * 100
    assert common_prefix_len(run, other, 0, 300) == 200
    assert common_prefix_len(run, [9] + run, 1, 150) == 149


def test_hit_never_covers_the_whole_sequence():
    kv = RadixPrefixCache(32, 1)
    a = cached_then_freed(kv, range(10))
    assert kv.lookup(make_request(range(10))) == 9  # last token recomputed for its logits
    assert kv.lookup(make_request(range(12))) == 10
    assert kv.lookup(make_request([1])) == 0
    assert a.num_cached_tokens == 0


def test_match_inside_a_node_splits_it_without_copying_kv():
    kv = RadixPrefixCache(32, 1)
    a = make_request([1, 2, 3, 4, 5, 6])
    run_to_completion(kv, a)
    a_pages = list(kv.page_table(a))
    assert kv.tree.num_nodes == 1
    b = make_request([1, 2, 3, 9, 9])
    assert kv.lookup(b) == 3 and admit(kv, b)
    kv.check_invariants()
    # the node was cut at 3: upper keeps a's first 3 page ids, lower the rest; no page moved or was copied
    root = kv.tree.root((None, None))
    upper = root.children[1]
    assert upper.tokens == [1, 2, 3] and upper.pages == a_pages[:3]
    assert upper.children[4].pages == a_pages[3:]
    assert kv.page_table(a) == a_pages
    assert kv.page_table(b)[:3] == a_pages[:3]
    assert b.num_computed_tokens == 3 and b.num_cached_tokens == 3
    assert kv.num_free_pages() == 32 - 6 - 2


def test_eviction_takes_lru_leaf_first_then_the_parent_that_became_a_leaf():
    kv = RadixPrefixCache(64, 1)
    a = make_request([1, 2, 3, 4, 90])
    run_to_completion(kv, a)
    a_pages = list(kv.page_table(a))
    kv.free(a)
    cached_then_freed(kv, [1, 2, 5, 6, 91])  # freed later: more recently used
    assert kv.tree.num_nodes == 3 and kv.tree.evictable_tokens == 8
    freed = kv.tree.evict(3)
    assert sorted(freed) == sorted(a_pages[2:])  # a's own tail, not the shared [1, 2]
    kv._release(freed, "lru")
    kv.check_invariants()
    assert kv.lookup(make_request([1, 2, 3, 4, 90, 0])) == 2  # a's leaf went first
    assert kv.lookup(make_request([1, 2, 5, 6, 91, 0])) == 5
    kv._release(kv.tree.evict(3), "lru")  # then b's leaf; [1, 2] is now a leaf itself
    kv.check_invariants()
    assert kv.lookup(make_request([1, 2, 5, 6, 91, 0])) == 2
    kv._release(kv.tree.evict(2), "lru")
    kv.check_invariants()
    assert kv.tree.num_nodes == 0 and kv.tree.roots == {} and kv.num_free_pages() == 64


def test_eviction_trims_a_leaf_from_its_tail_when_less_is_needed():
    kv = RadixPrefixCache(16, 1)
    cached_then_freed(kv, range(10))
    kv._release(kv.tree.evict(4), "lru")
    kv.check_invariants()
    assert kv.lookup(make_request(range(12))) == 6


def test_locked_prefix_survives_pressure_and_failed_allocation_changes_nothing():
    kv = RadixPrefixCache(12, 1)
    running = make_request([7] * 6)
    run_to_completion(kv, running)  # holds 6 pages, locked
    cached_then_freed(kv, [1, 2, 3, 4])  # 4 evictable pages
    assert kv.num_free_pages() == 6
    big = make_request(range(100, 107))  # 7 pages: more than free + evictable
    before = (kv.summary(), list(kv.page_table(running)), list(kv._free))
    assert not admit(kv, big)
    assert (kv.summary(), list(kv.page_table(running)), list(kv._free)) == before
    kv.check_invariants()
    fits = make_request(range(100, 106))  # 6 pages: evicts the unlocked prefix, never the running one
    assert admit(kv, fits)
    kv.check_invariants()
    assert kv.lookup(make_request([1, 2, 3, 4, 5])) == 0
    assert kv.lookup(make_request([7] * 8)) == 6
    assert kv.num_free_pages() == 0


def test_failed_admission_with_hit_leaves_locks_and_roots_as_they_were():
    kv = RadixPrefixCache(8, 1)
    cached_then_freed(kv, [1, 2, 3, 4], cache_salt="t")
    req = make_request([1, 2, 3, 4] + list(range(10, 20)), cache_salt="t")
    assert not admit(kv, req)
    kv.check_invariants()
    assert kv.tree.protected_tokens == 0 and req.num_computed_tokens == 0 and req.num_cached_tokens == -1
    assert not admit(kv, make_request(range(50, 70), cache_salt="new tenant"))
    assert set(kv.tree.roots) == {(None, "t")}


def test_namespaces_are_isolated():
    kv = RadixPrefixCache(64, 1)
    tokens = list(range(20))
    cached_then_freed(kv, tokens)
    assert kv.lookup(make_request(tokens)) == 19
    assert kv.lookup(make_request(tokens, cache_salt="a")) == 0
    assert kv.lookup(make_request(tokens, lora_id="adapter")) == 0
    cached_then_freed(kv, tokens, cache_salt="a")
    assert kv.lookup(make_request(tokens, cache_salt="a")) == 19
    assert kv.lookup(make_request(tokens, cache_salt="b")) == 0
    assert len(kv.tree.roots) == 2


def test_multimodal_inputs_with_different_hashes_do_not_match():
    kv = RadixPrefixCache(64, 1)
    tokens = [5, 5] + [0] * 8 + [6, 7]  # 8 image placeholder tokens
    cached_then_freed(kv, tokens, mm_hashes=(MultiModalHash(2, 8, "cat"),))
    assert kv.lookup(make_request(tokens, mm_hashes=(MultiModalHash(2, 8, "cat"),))) == 11
    assert kv.lookup(make_request(tokens, mm_hashes=(MultiModalHash(2, 8, "dog"),))) == 2
    assert kv.lookup(make_request(tokens)) == 2


def test_page_size_16_matches_whole_pages_only():
    kv = RadixPrefixCache(64, 16)
    base = list(range(40))
    a = make_request(base)
    run_to_completion(kv, a)
    assert kv.tree.evictable_tokens + kv.tree.protected_tokens == 32  # the 8-token tail page is private
    kv.free(a)
    kv.check_invariants()
    assert kv.lookup(make_request(base[:35] + [-1] * 10)) == 32
    assert kv.lookup(make_request(base[:31] + [-1] * 10)) == 16
    assert kv.lookup(make_request(base[:15] + [-1] * 10)) == 0
    assert kv.lookup(make_request(base[:33])) == 32
    assert kv.lookup(make_request(base[:32])) == 16  # 32 would cover the last token
    # a mismatch inside the second page splits on the page boundary
    b = make_request(base[:20] + [-1] * 20)
    assert admit(kv, b) and b.num_computed_tokens == 16
    compute(kv, b)
    kv.check_invariants()
    assert kv.tree.num_nodes == 3


def test_concurrent_duplicate_prefill_frees_the_second_copy():
    kv = RadixPrefixCache(32, 1)
    a, b = make_request(range(10)), make_request(range(10))
    assert admit(kv, a) and admit(kv, b)  # both miss: nothing cached yet
    assert kv.num_free_pages() == 12
    compute(kv, a)
    compute(kv, b)  # b's 10 pages duplicate a's: returned, b now points at a's pages
    kv.check_invariants()
    assert kv.page_table(b) == kv.page_table(a)
    assert kv.num_free_pages() == 22
    kv.free(a)
    kv.check_invariants()
    assert kv.tree.protected_tokens == 10  # b still holds the path
    kv.free(b)
    assert kv.tree.evictable_tokens == 10 and kv.num_free_pages() == 32


def test_running_request_is_shareable_chunk_by_chunk_and_while_decoding():
    kv = RadixPrefixCache(64, 4)
    a = make_request(range(20))
    assert kv.allocate(a, 8)  # first chunk
    compute(kv, a)
    assert kv.lookup(make_request(range(30))) == 8
    assert kv.allocate(a, 12)
    compute(kv, a)
    a.token_ids += [100, 101, 102, 103, 104]  # decoding
    assert kv.allocate(a, 5)
    compute(kv, a, 4)
    kv.check_invariants()
    assert kv.lookup(make_request(list(range(20)) + [100, 101, 102, 103, 104, 105])) == 24
    kv.free(a)
    kv.check_invariants()


def test_reset_drops_unlocked_nodes_and_reports_holders():
    kv = RadixPrefixCache(64, 1)
    cached_then_freed(kv, range(10))
    running = make_request(range(100, 110))
    run_to_completion(kv, running)
    assert kv.reset_prefix_cache() is False  # a running request still holds its pages
    kv.check_invariants()
    assert kv.lookup(make_request(range(12))) == 0
    assert kv.lookup(make_request(range(100, 112))) == 10
    kv.free(running)
    assert kv.reset_prefix_cache() is True
    kv.check_invariants()
    assert kv.tree.num_nodes == 0 and kv.num_free_pages() == 64 and kv._free.__len__() == 64


def test_stats_summary_and_render():
    kv = RadixPrefixCache(256, 1)
    system = list(range(1000, 1032))
    for i in range(4):
        cached_then_freed(kv, system + [i, i + 1, i + 2])
    s = kv.summary()
    assert s.type == "radix" and s.details["nodes"] == 5 and s.cached_tokens == 32 + 4 * 3
    assert s.details["evictable_tokens"] == 44 and s.details["protected_tokens"] == 0
    assert s.queries == 4 * 35 and s.hits == 3 * 32
    assert s.top_prefixes[0] == HotPrefix(cache_salt=None, lora_id=None, tokens=32, hits=3, locks=0)
    text = kv.render_tree(tokenizer_decode=lambda ids: "tok" * len(ids), max_depth=2, max_children=2)
    assert "+32 tok" in text and "hits=3" in text and "... 2 more" in text
    assert "'toktok" in text
    assert "1000 1001" in kv.render_tree()


def test_lookup_memo_follows_tree_changes():
    kv = RadixPrefixCache(64, 1)
    probe = make_request(range(12))
    assert kv.lookup(probe) == 0
    cached_then_freed(kv, range(10))
    assert kv.lookup(probe) == 10
    kv.reset_prefix_cache()
    assert kv.lookup(probe) == 0


def test_lookup_memo_survives_evictions_elsewhere_and_sees_its_own():
    """An eviction invalidates only the memos whose own nodes lost tokens: the rest resume where they were (a long
    queue is not matched again from the root after every eviction), and those that did shrink see it."""
    kv = RadixPrefixCache(64, 1)
    cached_then_freed(kv, range(100, 110))  # A: one 10-token leaf
    cached_then_freed(kv, range(200, 210))  # B
    on_a, on_b = make_request([*range(100, 110), 1, 2]), make_request([*range(200, 208), 3, 4])
    assert kv.lookup(on_a) == 10 and kv.lookup(on_b) == 8  # on_b stops inside B's leaf
    cached_then_freed(kv, range(100, 110))  # touch A: B is now the least recently used leaf
    memo_a = kv._lookups[on_a.request_id].memo
    kv._release(kv.tree.evict(3), "lru")  # trims B's tail (LRU leaf first)
    assert kv.lookup(on_b) == 7  # B lost its last 3 tokens: the match inside it shrinks
    assert kv.lookup(on_a) == 10 and kv._lookups[on_a.request_id].memo.node is memo_a.node  # resumed, not redone
    kv._release(kv.tree.evict(7), "lru")  # the rest of B
    assert kv.lookup(on_b) == 0 and kv.lookup(on_a) == 10
    kv._release(kv.tree.evict(10), "lru")  # A
    assert kv.lookup(on_a) == 0
    kv.check_invariants()


def test_tree_insert_moves_the_lock_down():
    tree = RadixTree(1)
    root = tree.root("ns", create=True)
    tree.lock(root)
    node, pages = tree.insert(root, [1, 2, 3], 0, 3, [10, 11, 12])
    assert pages == [10, 11, 12] and node.lock_ref == 1 and root.lock_ref == 1
    assert tree.protected_tokens == 3 and tree.evictable_tokens == 0
    assert tree.evict(3) == []
    tree.unlock(node)
    assert tree.evictable_tokens == 3
    assert sorted(tree.evict(5)) == [10, 11, 12] and tree.roots == {}


# -- growth in place: a request's own leaf gets longer instead of gaining a child per page ----------------------
def decode(kv, req, tokens, check_every=0):
    """Sample `tokens` one at a time: room for each, then a forward pass computes it and commits."""
    for n, token in enumerate(tokens, 1):
        req.token_ids.append(token)
        assert kv.allocate(req, 1)
        compute(kv, req, 1)
        if check_every and n % check_every == 0:
            kv.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_long_decode_keeps_one_node(page_size):
    """500-token prompt, 1,000 output tokens: one node per page before (1,000 at page size 1); SGLang keeps 2."""
    kv = RadixPrefixCache(2048, page_size)
    req = make_request(range(500))
    assert admit(kv, req, budget=200)  # chunked prefill: the later chunks grow the first chunk's node too
    compute(kv, req)
    assert kv.allocate(req, 300)
    compute(kv, req)
    decode(kv, req, range(10_000, 11_000), check_every=100)
    assert kv.tree.num_nodes <= 3
    kv.free(req)
    kv.check_invariants()
    assert kv.tree.num_nodes <= 3
    assert kv.tree.evictable_tokens == 1500 - 1500 % page_size
    conversation = make_request(list(range(500)) + list(range(10_000, 11_000)) + [7])
    assert kv.lookup(conversation) == 1500 - 1500 % page_size
    kv._release(kv.tree.evict(640 // page_size), "lru")  # the one big leaf is trimmed from its tail
    kv.check_invariants()
    assert kv.lookup(conversation) == 1500 - 1500 % page_size - 640


@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_turn_adds_one_node_per_turn(page_size):
    """Turn t+1's prompt is turn t's prompt, its answer and a new message: it hits all of turn t's committed
    tokens and hangs its own message and answer below them as one node."""
    kv = RadixPrefixCache(4096, page_size)
    conversation = list(range(300))
    hits = []
    for turn in range(4):
        req = make_request(conversation)
        assert admit(kv, req)
        hits.append(req.num_cached_tokens)
        compute(kv, req)
        decode(kv, req, range(10_000 * (turn + 1), 10_000 * (turn + 1) + 100))
        kv.free(req)
        kv.check_invariants()
        assert kv.tree.num_nodes == turn + 1
        conversation = req.token_ids + list(range(1000 * (turn + 1), 1000 * (turn + 1) + 40))
    assert hits[0] == 0
    for turn in range(1, 4):  # everything the previous turn committed (whole pages)
        committed = 300 + turn * 140 - 40
        assert hits[turn] == committed - committed % page_size
    assert [n.hits for n in kv.tree.nodes()] == [3, 2, 1, 0]  # one chain, root side first


def test_a_shared_or_hit_leaf_gets_a_child_not_growth():
    kv = RadixPrefixCache(256, 1)
    a = make_request(range(10))
    run_to_completion(kv, a)
    b = make_request(range(10))
    assert admit(kv, b)  # both hold a's node now: neither may grow it
    decode(kv, a, [50])
    decode(kv, b, [60])
    kv.check_invariants()
    assert kv.tree.num_nodes == 3
    decode(kv, a, [51, 52])  # a's own new leaf grows
    assert kv.tree.num_nodes == 3 and kv.tree.depth(kv._requests[a.request_id].node) == 13
    kv.free(a)
    kv.free(b)
    c = make_request(list(range(10)) + [50, 51, 52, 7])  # hits a's whole path, which is then nobody's but c's
    assert admit(kv, c) and c.num_cached_tokens == 13
    decode(kv, c, [8, 9])  # the hit node counts a hit for every token of it: the new ones go below
    kv.check_invariants()
    assert kv.tree.num_nodes == 4


def test_a_split_keeps_the_growing_lower_part_with_its_request():
    kv = RadixPrefixCache(256, 4)
    a = make_request(range(20))
    run_to_completion(kv, a)
    decode(kv, a, range(100, 112))
    b = make_request(list(range(12)) + [-1] * 5)  # its hit ends inside a's node: split at 12
    assert admit(kv, b) and b.num_cached_tokens == 12
    a_node = kv._requests[a.request_id].node
    decode(kv, a, range(200, 208))
    kv.check_invariants()
    assert kv._requests[a.request_id].node is a_node and not a_node.children
    assert kv.tree.depth(a_node) == 40 and kv.tree.num_nodes == 2
    assert kv.page_table(b)[:3] == kv.page_table(a)[:3]


def test_memoised_lookup_sees_a_node_that_grew():
    """A waiting request's match ended at the end of a running request's leaf; the leaf then grows by the very
    tokens the waiting request has next: the memo must not resume at the leaf's old end."""
    for page_size in (1, 4):
        kv = RadixPrefixCache(256, page_size)
        a = make_request(range(16))
        run_to_completion(kv, a)
        waiting = make_request(list(range(16)) + list(range(100, 120)) + [7])
        assert kv.lookup(waiting) == 16
        decode(kv, a, range(100, 112))
        fresh = kv.tree.match(waiting.extra_keys, waiting.token_ids, waiting.num_tokens - 1)[1]
        assert fresh == 28
        assert kv.lookup(waiting) == fresh
        decode(kv, a, range(112, 120))
        assert kv.lookup(waiting) == 36
        kv.check_invariants()


def test_memoised_lookup_sees_growth_after_a_split():
    """A split takes 8 tokens off the head of the memo's node and growth adds 8 at its tail: same length, later
    end. The memo tells by the node's last page, which a split keeps and growth replaces."""
    kv = RadixPrefixCache(256, 1)
    a = make_request(range(16))
    run_to_completion(kv, a)
    waiting = make_request(list(range(16)) + list(range(100, 120)) + [7])
    assert kv.lookup(waiting) == 16
    b = make_request(list(range(8)) + [-1, -1])
    assert admit(kv, b) and b.num_cached_tokens == 8
    a_node = kv._requests[a.request_id].node
    assert len(a_node.tokens) == 8
    decode(kv, a, range(100, 108))
    assert len(a_node.tokens) == 16 and kv.lookup(waiting) == 24
    kv.check_invariants()


# -- property test: random operations through the KVCacheManager API ----------------------------------------
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]


class RadixMachine(RuleBasedStateMachine):
    """Requests come, are prefilled in chunks, decode, get preempted, finish; the pool is small so eviction and
    failed allocations are common. A shadow of the KV pool records which token sequence each slot was written
    for: a request may only write its private pages, and everything it has computed must still read back as
    its own tokens (so no locked page was ever evicted and reused)."""

    @initialize(
        num_pages=st.integers(3, 24), page_size=st.sampled_from([1, 2, 4]), eviction=st.sampled_from(EVICTION_POLICIES)
    )
    def setup(self, num_pages, page_size, eviction):
        self.kv = RadixPrefixCache(num_pages, page_size, eviction=eviction)
        self.waiting = []
        self.running = []
        self.finished = []
        self.slot_content = {}
        self.next_token = 1000

    def _ns_keys(self, req, i):
        return (req.extra_keys, tuple(req.token_ids[: i + 1]))

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
        salt=st.sampled_from([None, None, "t"]),
    )
    def arrive(self, prefix, suffix, salt):
        self.waiting.append(make_request(prefix + suffix, cache_salt=salt))

    @precondition(lambda self: self.finished)
    @rule(i=st.integers(0, 10), suffix=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def follow_up(self, i, suffix):
        """The next turn of a finished conversation: all its tokens, then a new message."""
        done = self.finished[i % len(self.finished)]
        self.waiting.append(make_request(done.token_ids + suffix, cache_salt=done.cache_salt))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 10), chunk=st.integers(1, 12))
    def admit(self, i, chunk):
        req = self.waiting[i % len(self.waiting)]
        cached = self.kv.lookup(req)
        assert cached % self.kv.page_size == 0 and cached < req.num_tokens
        n = min(chunk, req.num_tokens - cached)
        free_before = self.kv.num_free_pages()
        if admit_request(self.kv, req, n, cached):
            assert req.num_computed_tokens == cached
            self.waiting.remove(req)
            self.running.append(req)
            self._check_readback(req)
        else:
            assert self.kv.num_free_pages() == free_before and req.num_computed_tokens == 0
            assert self.kv.page_table(req) == []

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10), k=st.integers(1, 12))
    def forward(self, i, k):
        """Compute up to k allocated tokens, then commit."""
        req = self.running[i % len(self.running)]
        ps = self.kv.page_size
        table = self.kv.page_table(req)
        cap = min(len(table) * ps, req.num_tokens)
        end = min(req.num_computed_tokens + k, cap)
        state = self.kv._requests[req.request_id]
        for pos in range(req.num_computed_tokens, end):
            assert pos // ps >= state.committed // ps, "writing into a shared tree page"
            self.slot_content[table[pos // ps] * ps + pos % ps] = self._ns_keys(req, pos)
        req.num_computed_tokens = max(req.num_computed_tokens, end)
        nodes, node, grows = self.kv.tree.num_nodes, state.node, self.kv.tree._grows_in_place(state.node)
        self.kv.commit(req)
        if grows:  # the request's own unshared leaf takes the new pages: no node is added
            assert self.kv.tree.num_nodes == nodes and self.kv._requests[req.request_id].node is node

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10), k=st.integers(1, 12))
    def extend(self, i, k):
        """Next prefill chunk, or one decode step once the sequence is computed (preempt on failure)."""
        req = self.running[i % len(self.running)]
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(self.next_token % 4)
            self.next_token += 1
            k = 1
        n = min(k, req.num_tokens - req.num_computed_tokens)
        if not self.kv.allocate(req, n):
            self.preempt_request(req)

    def preempt_request(self, req):
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10))
    def preempt(self, i):
        self.preempt_request(self.running[i % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        req = self.running.pop(i % len(self.running))
        self.kv.free(req)
        self.finished.append(req)

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        protected = self.kv.tree.protected_tokens
        self.kv._release(self.kv.tree.evict(n), "lru")
        assert self.kv.tree.protected_tokens == protected

    @rule()
    def reset(self):
        assert self.kv.reset_prefix_cache() == (not self.running)
        assert self.kv.tree.evictable_tokens == 0

    def _check_readback(self, req):
        ps = self.kv.page_size
        table = self.kv.page_table(req)
        for pos in range(req.num_computed_tokens):
            assert self.slot_content.get(table[pos // ps] * ps + pos % ps) == self._ns_keys(req, pos), (
                "computed KV of a running request was overwritten or never written"
            )

    @invariant()
    def accounting(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        for req in self.running:
            self._check_readback(req)
        for req in self.waiting:  # the memoised lookup equals a fresh match from the root
            fresh = self.kv.tree.match(req.extra_keys, req.token_ids, req.num_tokens - 1)[1]
            assert self.kv.lookup(req) == fresh
            path = self.kv.prefix_path(req)  # dfs-weight's view: the nodes of exactly that prefix, attached
            assert sum(len(n.tokens) for n in path) == fresh and all(n.parent is not None for n in path)
            assert all(a is b.parent for a, b in zip(path, path[1:]))
        if not self.running:
            assert self.kv.num_free_pages() == self.kv.num_pages


RadixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixMachine = RadixMachine.TestCase
