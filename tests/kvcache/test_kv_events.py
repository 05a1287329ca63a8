"""KV events: a subscriber that applies the event stream holds exactly the cache's blocks, and both caches name a
page by the same hash (so one router index serves replicas of either)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, apply_events
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.hashing import prompt_block_hashes
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.request import MultiModalHash
from tests.kvcache.helpers import admit, compute, make_request

PAGE = 4
BASES = [list(range(100, 140)), list(range(100, 112)) + list(range(200, 230)), [7] * 40]

arrival = st.tuples(
    st.just("run"),
    st.sampled_from(range(len(BASES))),
    st.integers(0, 40),  # prefix of the base
    st.lists(st.integers(0, 2), max_size=12),  # own suffix
    st.sampled_from([None, None, "a", "b"]),  # cache_salt
    st.sampled_from([None, None, "lora1"]),
    st.integers(1, 24),  # first chunk
    st.booleans(),  # keep running (else freed at once)
)
operation = st.one_of(
    arrival,
    arrival,
    arrival,
    st.tuples(st.just("free"), st.integers(0, 10)),
    st.tuples(st.just("preempt"), st.integers(0, 10), st.integers(1, 12)),  # freed in the step of its allocation
    st.tuples(st.just("reset"), st.sampled_from([None, "a", "b"])),
)


def make_caches(num_pages):
    caches = [
        HashPrefixCache(num_pages, PAGE),
        HashPrefixCache(num_pages, PAGE, eviction="lfu"),
        RadixPrefixCache(num_pages, PAGE),
        RadixPrefixCache(num_pages, PAGE, eviction="lfu"),
    ]
    for kv in caches:
        kv.enable_events()
    return caches


def play(kv, operations, check):
    """Run one workload on kv, calling check() after every operation."""
    running = []
    for op in operations:
        if op[0] == "run":
            _, base, cut, suffix, salt, lora, chunk, keep = op
            req = make_request(BASES[base][:cut] + suffix or [1], cache_salt=salt, lora_id=lora)
            if admit(kv, req, chunk):
                compute(kv, req)
                if kv.allocate(req, req.num_tokens - req.num_computed_tokens):
                    compute(kv, req)
                if keep and len(running) < 2:
                    running.append(req)
                else:
                    kv.free(req)
            else:
                kv.free(req)
        elif op[0] == "free" and running:
            kv.free(running.pop(op[1] % len(running)))
        elif op[0] == "preempt" and running:  # decodes allocated (their pages keyed in flight), never computed
            req = running.pop(op[1] % len(running))
            req.token_ids.extend(range(op[2]))
            kv.allocate(req, req.num_tokens - req.num_computed_tokens)
            kv.free(req)
        elif op[0] == "reset":
            salt = op[1]
            kv.reset_prefix_cache(None if salt is None else (lambda s, salt=salt: s == salt))
        check()
    return running


@settings(max_examples=30, deadline=None)
@given(st.lists(operation, max_size=25))
def test_subscriber_rebuilds_the_cached_blocks(operations):
    """A small pool (12 pages of 4 tokens) so most workloads evict; resets full and per tenant."""
    for kv in make_caches(12):
        mirror: set[int] = set()

        def check(kv=kv, mirror=mirror):
            apply_events(mirror, kv.drain_events())
            assert mirror == kv.cached_block_hashes()
            kv.check_invariants()

        play(kv, operations, check)


@settings(max_examples=30, deadline=None)
@given(st.lists(arrival, max_size=20))
def test_both_caches_store_the_same_hashes(operations):
    """Without eviction pressure the radix tree and the hash chain store the same pages, named by the same
    hashes, and those are what prompt_block_hashes gives a router for each prompt."""
    stored = []
    for kv in make_caches(4096):
        seen: list[int] = []
        for event in kv.drain_events():
            raise AssertionError(event)  # nothing before the first request
        play(kv, operations, lambda: None)
        for event in kv.drain_events():
            assert isinstance(event, BlockStored)
            assert len(event.token_ids) == len(event.block_hashes) * PAGE
            seen.extend(event.block_hashes)
        assert len(seen) == len(set(seen)) == len(kv.cached_block_hashes())
        stored.append(set(seen))
    assert all(s == stored[0] for s in stored)
    expected = set()
    for _, base, cut, suffix, salt, lora, _, _ in operations:
        tokens = BASES[base][:cut] + suffix or [1]
        expected.update(prompt_block_hashes(tokens, PAGE, lora_id=lora, cache_salt=salt))
    assert stored[0] == expected


def test_event_fields_and_resets():
    """Stored pages chain to their parent; a tenant reset removes its pages; a full reset of an idle cache
    clears all at once."""
    for kv in make_caches(64):
        a = make_request(list(range(10)), cache_salt="a")
        b = make_request(list(range(9)))
        for req in (a, b):
            assert admit(kv, req)
            compute(kv, req)
            kv.free(req)
        events = kv.drain_events()
        hashes_a = prompt_block_hashes(list(range(10)), PAGE, cache_salt="a")
        hashes_b = prompt_block_hashes(list(range(9)), PAGE)
        assert hashes_a != hashes_b[: len(hashes_a)]  # the salt changes every hash of the chain
        full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        assert events == [
            BlockStored(hashes_a, None, list(range(8)), PAGE, extra_keys=[("salt:a",), None], **full),
            BlockStored(hashes_b, None, list(range(8)), PAGE, extra_keys=[None, None], **full),
        ], kv.name
        kv.reset_prefix_cache(lambda s: s == "a")
        removed = kv.drain_events()
        assert all(isinstance(e, BlockRemoved) for e in removed)
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes_a)
        assert kv.reset_prefix_cache()
        assert kv.drain_events() == [AllBlocksCleared()]
        assert kv.cached_block_hashes() == set()


def test_adapter_and_multimodal_pages_hash_alike():
    """Pages keyed by an adapter and an image (the radix tree keys image positions by the image's hash) get the
    hash chain's names in both caches, with their extra keys listed per block."""
    mm = (MultiModalHash(3, 6, "img1"),)
    tokens = list(range(20))
    stored = []
    for kv in make_caches(64):
        req = make_request(tokens, mm_hashes=mm, lora_id="l")
        assert admit(kv, req)
        compute(kv, req)
        kv.free(req)
        stored.append(kv.drain_events())
    assert all(events == stored[0] for events in stored)
    (event,) = stored[0]
    assert event.block_hashes == prompt_block_hashes(tokens, PAGE, lora_id="l", mm_hashes=mm)
    assert event.lora_name == "l"
    assert event.extra_keys == [("lora:l", "mm:img1")] * 3 + [("lora:l",)] * 2
