"""Automatic prefix caching with block hash chains (the semantics of vLLM's APC).

Every page of the pool is a preallocated Block. A full block whose tokens have been computed gets a key (see
hashing.py) and goes into one flat map key -> block. A new request walks its chain of keys from block 0 and
stops at the first miss; the hit blocks are shared (ref_cnt) instead of recomputed. Freed blocks keep their key
and sit in the free queue, least recently used at the head; allocation takes the head and evicts its key then.

Other eviction policies (eviction.py) keep the free queue for its O(1) accounting and hit removal, uncached blocks
at its head, and choose among cached free blocks with a heap of chain tails: blocks whose key no cached block
names as its parent. Evicting anything else would strand cached blocks no lookup can reach, so a child count per
key tells a tail; evicting a tail can make its parent one.

Retention (retention.py): a retained free block that comes up for eviction is set aside ("parked", out of the
free queue but still counted free and still findable) while anything else is free; it goes back to the front of
the eviction order when its retention ends, or is evicted, weakest first, once nothing else is left.

Keyed before computed (keys_in_flight_pages, vLLM's v1 rule): allocate() keys the full blocks the request's chunk
completes right away, so a request admitted later in the same step hits them instead of computing them again.
That is safe because the forward pass writes every row's new K/V into the pool before any row attends (layer by
layer), and nothing reads the pool between scheduling and that pass. Such a block is "in flight" until commit()
sees it computed; if its request is freed before that (preempted in the step that allocated it, or a failed
step's abort), free() takes the key back (BlockRemoved), so no later lookup finds KV that was never written.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixkv.cache_miss import CacheMiss
from prefixkv.kvcache.events import block_removed, block_stored
from prefixkv.kvcache.eviction import EvictionHeap, make_eviction_policy
from prefixkv.kvcache.free_block_queue import Block, FreeBlockQueue
from prefixkv.kvcache.hashing import extend_block_keys, external_block_hash, hash_function
from prefixkv.kvcache.manager import NOTHING_INSERTED, Inserted, PagedKVCache, runs_of
from prefixkv.kvcache.retention import retain_request_pages
from prefixkv.kvcache.summary import CacheSummary, NamespaceUsage
from prefixkv.request import Request


@dataclass(slots=True)
class _Keys:
    """What lookups learnt about one request: its block keys (token ids only grow, so they stay valid) and the
    last match, valid while no key has been evicted since (keys only leave the map on eviction)."""

    request: Request
    hashes: list[bytes] = field(default_factory=list)
    matched_blocks: int = 0
    matched_at_evictions: int = -1  # num_evictions when matched_blocks was found


@dataclass(slots=True)
class _Held:
    """The blocks a running request holds, in position order. Blocks [num_committed, num_keyed) that carry a key
    are keyed in flight by this request: keyed at allocation, not yet seen computed."""

    blocks: list[Block]
    page_ids: list[int]  # the same blocks' ids: page_table() runs every step
    num_keyed: int  # leading blocks keyed (or left private: another block held their key first)
    num_committed: int  # leading blocks known computed: the hit's, and those commit() has seen


class HashPrefixCache(PagedKVCache):
    name = "hash"
    caching = True  # NoPrefixCache turns this off and keeps the same block pool

    def __init__(
        self,
        num_pages: int,
        page_size: int = 16,
        *,
        hash_algo: str = "sha256",
        eviction: str = "lru",
        retained_pool_fraction: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        keys_in_flight_pages: bool = True,
        miss_history: int | None = None,
    ) -> None:
        """keys_in_flight_pages=False keys a block only once computed (at commit), as a radix tree inserts."""
        super().__init__(num_pages, page_size, retained_pool_fraction, clock, miss_history)
        self.keys_in_flight_pages = keys_in_flight_pages and self.caching
        self._hash_fn = hash_function(hash_algo)
        self.hash_algo = hash_algo
        self.blocks = [Block(i) for i in range(num_pages)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self._held: dict[str, _Held] = {}  # by request id, from allocate to free
        self._in_flight: dict[int, str] = {}  # block id -> id of the request that keyed it before it was computed
        self._keys: dict[str, _Keys] = {}  # by request id, from the first lookup to free
        self.num_evictions = 0  # keys only leave the map on eviction: a memoised match stays valid until then
        self.eviction = make_eviction_policy(eviction)
        # LRU: the free queue's order. Other policies: cached free chain tails by priority, and per key the number
        # of cached blocks that continue it (a key with none ends its chain)
        self._tails: EvictionHeap[Block] | None = None if self.eviction.name == "lru" else EvictionHeap()
        self._num_children: dict[bytes, int] = {}
        self._release_clock = 0  # counts free() calls: the last_access the policy sees
        self._parked: dict[int, Block] = {}  # retained free blocks set aside by eviction, by block id
        # the parked blocks weakest first: (retention rank when parked, park order, block id); stale entries (the
        # block left, or its retention was strengthened) are skipped or re-ranked when they come up
        self._parked_order: list[tuple[tuple[int, float, int], int, int]] = []
        self._park_seq = itertools.count()
        self.retention.on_end = self._unpark  # a parked block whose retention ends is ordinary again

    # -- keys ----------------------------------------------------------------------------------------------
    def _keys_of(self, request: Request) -> _Keys:
        keys = self._keys.get(request.request_id)
        if keys is None or keys.request is not request:
            keys = self._keys[request.request_id] = _Keys(request)
        return keys

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first num_blocks full blocks (at least; memoised until free())."""
        hashes = self._keys_of(request).hashes
        if len(hashes) >= num_blocks:
            return hashes
        return extend_block_keys(
            hashes,
            request.token_ids,
            self.page_size,
            num_blocks,
            self._hash_fn,
            request.lora_id,
            request.cache_salt,
            request.mm_hashes,
        )

    # -- queries -------------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        if not self.caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.page_size  # the last token is always recomputed
        memo = self._keys_of(request)
        n = memo.matched_blocks if memo.matched_at_evictions == self.num_evictions else 0
        n = min(n, max_blocks)
        cached = self.cached
        hashes = self.block_hashes(request, max_blocks)
        while n < max_blocks and hashes[n] in cached:
            n += 1
        memo.matched_blocks, memo.matched_at_evictions = n, self.num_evictions
        return n * self.page_size

    def explain_miss(self, request: Request, num_cached_tokens: int) -> CacheMiss | None:
        return self.misses.explain(request, num_cached_tokens) if self.caching else None

    def prefix_path(self, request: Request) -> list:
        """The keys of the cached prefix's blocks: a key names its whole prefix (it chains its parent's)."""
        num_blocks = self.lookup(request) // self.page_size
        return self.block_hashes(request, num_blocks)[:num_blocks] if num_blocks else []

    def page_table(self, request: Request) -> list[int]:
        held = self._held.get(request.request_id)
        return held.page_ids if held is not None else []

    def num_free_pages(self) -> int:
        return self.free_queue.num_free + len(self._parked)

    # -- changes -------------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        held = self._held.get(request.request_id)
        hit_blocks: list[Block] = []
        if num_cached_tokens:
            if held is not None:
                raise ValueError("a cache hit can only be taken at first admission")
            num_hit = num_cached_tokens // self.page_size
            hit_blocks = [self.cached[k] for k in self.block_hashes(request, num_hit)[:num_hit]]
        num_held = len(held.blocks) if held is not None else 0
        num_new_blocks = self.pages_needed(request, num_new_tokens, num_cached_tokens) - num_held - len(hit_blocks)
        reclaimed = sum(1 for b in hit_blocks if b.ref_cnt == 0)  # free now, but this request will hold them
        if num_new_blocks > self.num_free_pages() - reclaimed:
            return False

        if held is None:
            held = self._held[request.request_id] = _Held([], [], len(hit_blocks), len(hit_blocks))
            if self.caching:
                self.misses.admitted(request, num_cached_tokens)
        blocks = held.blocks
        for b in hit_blocks:
            if b.ref_cnt == 0 and self._parked.pop(b.block_id, None) is None:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            b.hits += 1
        blocks.extend(hit_blocks)
        if hit_blocks and request.retains:
            self._retain(request, hit_blocks, 0)
        for _ in range(max(0, num_new_blocks)):
            b = self._take_free_block()
            self._evict(b, self.eviction.name)
            b.ref_cnt = 1
            blocks.append(b)
        if self._on_invalid_pages is not None and num_new_blocks > 0:  # debug_nan_kv only: no list otherwise
            self._invalidated([b.block_id for b in blocks[len(blocks) - num_new_blocks :]])
        held.page_ids.extend(b.block_id for b in blocks[len(held.page_ids) :])
        if self.keys_in_flight_pages:
            end = min(request.num_computed_tokens + num_cached_tokens + num_new_tokens, request.num_tokens)
            self._key_blocks(request, held, end // self.page_size)  # (room reserved past the tokens keys nothing)
        return True

    def commit(self, request: Request) -> Inserted:
        """The blocks the step completed are computed now: no longer in flight; keyed here when allocate() did
        not key them already. This request's writes are the blocks it keyed itself (in flight, now computed, or
        keyed here), never one left private because another block held its key first."""
        if not self.caching:
            return NOTHING_INSERTED
        held = self._held[request.request_id]
        num_full = request.num_computed_tokens // self.page_size
        if num_full <= held.num_committed:
            return NOTHING_INSERTED
        written = []
        if self._in_flight:
            for i in range(held.num_committed, min(num_full, held.num_keyed)):
                if self._in_flight.pop(held.blocks[i].block_id, None) is not None:
                    written.append(i)
        held.num_committed = num_full
        written += self._key_blocks(request, held, num_full)
        return Inserted(runs_of(written, self.page_size), self.page_size) if written else NOTHING_INSERTED

    def _key_blocks(self, request: Request, held: _Held, num_full: int) -> list[int]:
        """Give the request's blocks up to num_full their keys, making them findable (a block whose key another
        block holds already stays private). Those past held.num_committed are in flight until commit(). Returns
        the indices of the blocks it keyed."""
        start = held.num_keyed
        if num_full <= start:
            return []
        keyed = []
        keys = self.block_hashes(request, num_full)
        stored: list[int] | None = [] if self._events is not None else None
        for i in range(start, num_full):
            key = keys[i]
            if key in self.cached:  # another request computed the same block first; ours stays private
                if stored:
                    self._emit_stored(request, keys, stored)
                    stored = []
            else:
                if stored is not None:
                    stored.append(i)
                keyed.append(i)
                block = held.blocks[i]
                block.block_hash = key
                block.cache_salt = request.cache_salt
                block.lora_id = request.lora_id
                block.hits = 0
                self.cached[key] = block
                self.misses.stored(block.block_id, request, i)
                if i >= held.num_committed:
                    self._in_flight[block.block_id] = request.request_id
                if self._tails is not None:
                    block.position = i * self.page_size
                    block.parent_hash = parent = keys[i - 1] if i else None
                    if parent is not None:
                        self._num_children[parent] = self._num_children.get(parent, 0) + 1
        if stored:
            self._emit_stored(request, keys, stored)
        held.num_keyed = num_full
        if request.retains:
            self._retain(request, [self.cached[keys[i]] for i in range(start, num_full)], start)
        return keyed

    def _retain(self, request: Request, blocks: list[Block], first_depth: int) -> None:
        retain_request_pages(self.retention, request, [b.block_id for b in blocks], first_depth, self.page_size)

    def _emit_stored(self, request: Request, keys: list[bytes], indices: list[int]) -> None:
        """One BlockStored for consecutive blocks `indices` of the request that just became findable."""
        assert self._events is not None
        self._events.append(block_stored(request, keys, indices[0], indices[-1] + 1, self.page_size))

    def free(self, request: Request) -> None:
        self._keys.pop(request.request_id, None)
        self.misses.forget(request.request_id)
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        if self._in_flight:
            self._unkey_in_flight(held)
        tails = self._tails
        if tails is not None:
            self._release_clock += 1
        uncached: list[int] | None = [] if self._on_invalid_pages is not None else None
        for b in reversed(held.blocks):  # tail first: chain ends are evicted before shared beginnings
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)  # holds nothing reusable: hand it out before any cached block
                    if uncached is not None:
                        uncached.append(b.block_id)
                else:
                    self.free_queue.append(b)
                    if tails is not None:
                        b.last_access, b.release_age = self._release_clock, self.eviction.age
                        if b.block_hash not in self._num_children:
                            self._push_tail(b)
        if uncached:
            self._invalidated(uncached)

    # -- eviction ------------------------------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        """The block the next allocation gets. LRU: the free queue's head. Other policies: an uncached block while
        there is one (they sit at the head), else the chain tail the policy ranks lowest, else (every cached free
        block is continued by a block a running request holds) the least recently freed. Retained blocks are
        parked instead while anything else is free (then the weakest retained one goes)."""
        retention = self.retention
        if not retention:  # nobody retains anything: the plain order
            block, priority = self._pop_free_block()
            if priority is not None:
                self.eviction.evicted(priority)
            return block
        retention.expire()
        while self.free_queue.num_free:
            block, priority = self._pop_free_block()
            if block.block_hash is None or block.block_id not in retention:
                if priority is not None:
                    self.eviction.evicted(priority)
                return block
            self._park(block)
        return self._take_weakest_parked()

    def _park(self, block: Block) -> None:
        self._parked[block.block_id] = block
        heapq.heappush(self._parked_order, (self.retention.rank(block.block_id), next(self._park_seq), block.block_id))
        if len(self._parked_order) > 2 * len(self._parked) + 64:
            live = [e for e in self._parked_order if e[2] in self._parked]
            heapq.heapify(live)
            self._parked_order = live

    def _take_weakest_parked(self) -> Block:
        """Every free block is retained: the weakest retention (retention.rank) loses its block."""
        order, retention = self._parked_order, self.retention
        while order:
            rank, _, block_id = heapq.heappop(order)
            if block_id not in self._parked:
                continue
            now = retention.rank(block_id)
            if now != rank:  # retained again since it was parked: ranked anew
                heapq.heappush(order, (now, next(self._park_seq), block_id))
                continue
            retention.discard(block_id)
            return self._parked.pop(block_id)
        raise IndexError("no free blocks")

    def _pop_free_block(self) -> tuple[Block, float | None]:
        """The next block in the policy's order, out of the free queue, with its eviction priority when it came
        from the heap of chain tails (the caller reports it to the policy if it evicts the block)."""
        tails = self._tails
        if tails is None:
            return self.free_queue.popleft(), None
        head, priority = self.free_queue.first(), None
        if head is not None and head.block_hash is not None:
            entry = tails.pop(self._is_free_tail)
            if entry is not None:
                priority, head = entry
        if head is None:
            raise IndexError("no free blocks")
        self.free_queue.remove(head)
        return head, priority

    def _unpark(self, block_id: int) -> None:
        """A parked block's retention ended: it is ordinary again, first in line (it was when it was parked)."""
        block = self._parked.pop(block_id, None)
        if block is None:
            return
        if self._tails is None:
            self.free_queue.appendleft(block)
        else:  # uncached blocks stay first; the heap ranks it among the other tails
            self.free_queue.append(block)
            if self._is_free_tail(block):
                self._push_tail(block)

    def _is_free_tail(self, block: Block) -> bool:
        return block.ref_cnt == 0 and block.block_hash is not None and block.block_hash not in self._num_children

    def _push_tail(self, block: Block) -> None:
        assert self._tails is not None
        priority = self.eviction.priority(
            block.release_age, block.last_access, block.hits, block.position, self.page_size
        )
        self._tails.push(block, priority, block.last_access)

    def _unkey_in_flight(self, held: _Held) -> None:
        """The request goes before its step computed the blocks it keyed in flight (preempted in the step that
        allocated them, or aborted after a failed step): take their keys back, so no lookup finds KV that was
        never written. Only requests scheduled in that same step can hold them too (a hit never outlives the
        step unless the step ran), and the scheduler frees nobody mid-step after admitting those."""
        for b in reversed(held.blocks[held.num_committed : held.num_keyed]):
            if self._in_flight.pop(b.block_id, None) is not None:
                self._drop_key(b)

    def _evict(self, block: Block, policy: str) -> None:
        if self._drop_key(block, policy):
            self.stats.evicted_pages += 1

    def _drop_key(self, block: Block, policy: str | None = None) -> bool:
        """Forget the block's key (BlockRemoved when it was findable: True then). policy: what evicted it (the
        miss listener remembers); None: not an eviction (a key taken back before its block was computed)."""
        key = block.block_hash
        if key is None:
            return False
        findable = self.cached.get(key) is block
        if findable:
            if policy is None:
                self.misses.unstored(block.block_id)
            else:
                self.misses.evicted(block.block_id, policy, self.retention.lapsed(block.block_id))
        self.retention.discard(block.block_id)
        if findable:
            del self.cached[key]
            if block.ref_cnt == 0:  # nobody holds it: its KV is gone (a holder keeps it until it frees it)
                self._invalidated([block.block_id])
            if self._events is not None:
                self._events.append(block_removed([external_block_hash(key)]))
            self.num_evictions += 1  # memoised matches are checked against this count
            if self._tails is not None and block.parent_hash is not None:
                self._forget_child(block.parent_hash)
        block.block_hash = None
        return findable

    def _forget_child(self, parent: bytes) -> None:
        """One cached block continuing `parent` went; with none left, the parent's block (if cached and free)
        ends its chain now and can be evicted."""
        left = self._num_children[parent] - 1
        if left:
            self._num_children[parent] = left
            return
        del self._num_children[parent]
        block = self.cached.get(parent)
        if block is not None and block.ref_cnt == 0:
            self._push_tail(block)

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Drop every cached block no request holds (only those whose cache_salt passes salt_filter, when
        given); True when nothing of that is left cached. Events: one BlockRemoved per dropped block, or one
        AllBlocksCleared for a full reset that left nothing cached."""
        mark = len(self._events) if self._events is not None else 0
        for block_id in list(self._parked):  # a reset drops retained KV too
            if salt_filter is None or salt_filter(self._parked[block_id].cache_salt):
                self.retention.discard(block_id)
                self._unpark(block_id)
        for b in list(self.free_queue):
            if salt_filter is None or (b.block_hash is not None and salt_filter(b.cache_salt)):
                self._evict(b, "reset")
                if self._tails is not None:  # other policies keep uncached free blocks at the head
                    self.free_queue.remove(b)
                    self.free_queue.appendleft(b)
        if salt_filter is None:
            if not self.cached and self.caching:
                self._collapse_full_reset(mark)
            return not self.cached
        return not any(salt_filter(b.cache_salt) for b in self.cached.values())

    def retain_cached(self, request: Request, seconds: float, priority: int = 0) -> int:
        if not self.retention.capacity:
            return 0
        num_blocks = self.lookup(request) // self.page_size
        pages = [self.cached[k].block_id for k in self.block_hashes(request, num_blocks)[:num_blocks]]
        self.retention.retain(pages, 0, priority, seconds)  # a free page is parked when eviction reaches it
        return len(pages)

    def release_retention(self, request: Request, keep_tokens: int = 0) -> int:
        if not self.retention:
            return 0
        num_blocks = self.lookup(request) // self.page_size
        keys = self.block_hashes(request, num_blocks)[keep_tokens // self.page_size : num_blocks]
        return len(self.retention.release([self.cached[k].block_id for k in keys]))  # on_end unparks them

    def num_cached_pages(self) -> int:
        return len(self.cached)

    def cached_block_hashes(self) -> set[int]:
        return {external_block_hash(key) for key in self.cached}

    # -- introspection -------------------------------------------------------------------------------------
    def summary(self) -> CacheSummary:
        out = super().summary()
        out.cached_tokens = len(self.cached) * self.page_size
        out.running_requests = len(self._held)
        out.by_namespace = self._by_namespace()
        out.details.update(
            block_size=self.page_size,
            hash_algo=self.hash_algo,
            eviction=self.eviction.name if self.caching else None,
            cached_blocks=len(self.cached),
            evictable_blocks=(sum(1 for b in self.free_queue if b.block_hash is not None) + len(self._parked))
            if self.caching
            else 0,
        )
        return out

    def _by_namespace(self) -> list[NamespaceUsage]:
        """Cached tokens per (cache_salt, adapter), largest first; the hash chain keeps no per-block hit count."""
        tokens: dict[tuple[str | None, str | None], int] = {}
        for b in self.cached.values():
            key = (b.cache_salt, b.lora_id)
            tokens[key] = tokens.get(key, 0) + self.page_size
        ordered = sorted(tokens.items(), key=lambda kv: (-kv[1], str(kv[0])))
        return [NamespaceUsage(salt, lora, n) for (salt, lora), n in ordered]

    def check_invariants(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free count drifted"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        num_free = len(free) + len(self._parked)
        assert num_free + len(in_use) == self.num_pages, f"{num_free} free + {len(in_use)} in use != {self.num_pages}"
        self.retention.check()
        self.misses.check({b.block_id for b in self.cached.values()})
        for block_id in self.retention.pages():
            block = self.blocks[block_id]
            assert block.block_hash is not None and self.cached.get(block.block_hash) is block, "retained, not cached"
        for block_id, block in self._parked.items():
            assert block.block_id == block_id and block.ref_cnt == 0 and block.prev_free is None, f"parked {block!r}"
            assert block_id in self.retention, f"{block!r} parked without a retention"
        assert all(b.ref_cnt == 0 for b in free), "a block with ref_cnt > 0 is in the free queue"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref_cnt"
        for key, b in self.cached.items():
            assert b.block_hash == key, f"cached key maps to {b!r} whose key differs"
        for held in self._held.values():
            assert held.page_ids == [b.block_id for b in held.blocks], "page ids drifted from blocks"
            assert held.num_keyed <= len(held.blocks), "keyed past the held blocks"
            assert all(b.block_hash is None for b in held.blocks[held.num_keyed :]), "a key past num_keyed"
        self._check_in_flight()
        if self._tails is not None:
            self._check_tails(free)
        holders: dict[int, int] = {}
        for held in self._held.values():
            for b in held.blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.blocks:
            assert holders.get(b.block_id, 0) == b.ref_cnt, f"{b!r} ref_cnt != number of requests holding it"

    def _check_in_flight(self) -> None:
        """Every keyed block is computed or in flight; an in-flight block is findable and held by the request that
        keyed it, past what that request has computed, so it is never free: only requests scheduled in the same
        step can find it before it is written."""
        expected: dict[int, str] = {}
        for request_id, held in self._held.items():
            for b in held.blocks[held.num_committed : held.num_keyed]:
                if b.block_hash is not None:
                    expected[b.block_id] = request_id
        assert self._in_flight == expected, f"in-flight blocks {self._in_flight} != keyed, uncommitted {expected}"
        for block_id in self._in_flight:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0 and block.block_hash is not None, f"{block!r} in flight, free or not keyed"
            assert self.cached.get(block.block_hash) is block, f"{block!r} in flight, not findable"

    def _check_tails(self, free: list[Block]) -> None:
        """Child counts match the cached blocks, uncached free blocks come first, every free tail is in the heap."""
        counts: dict[bytes, int] = {}
        for b in self.cached.values():
            if b.parent_hash is not None:
                counts[b.parent_hash] = counts.get(b.parent_hash, 0) + 1
        assert counts == self._num_children, "child counts drifted from the cached blocks"
        cached_seen = False
        for b in free:
            assert b.block_hash is not None or not cached_seen, "an uncached free block behind a cached one"
            cached_seen = cached_seen or b.block_hash is not None
        assert self._tails is not None
        in_heap = {id(b) for _, b in self._tails.current(self._is_free_tail)}
        assert all(id(b) in in_heap for b in free if self._is_free_tail(b)), "a free chain tail is not in the heap"
