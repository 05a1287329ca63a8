"""Automatic prefix caching with block hash chains (the semantics of vLLM's APC).

Every page of the pool is a preallocated Block. A full block whose tokens have been computed gets a key (see
hashing.py) and goes into one flat map key -> block. A new request walks its chain of keys from block 0 and
stops at the first miss; the hit blocks are shared (ref_cnt) instead of recomputed. Freed blocks keep their key
and sit in the free queue, least recently used at the head; allocation takes the head and evicts its key then.
"""
from __future__ import annotations

from collections.abc import Callable

from prefixkv.engine.request import Request
from prefixkv.kvcache.free_block_queue import Block, FreeBlockQueue
from prefixkv.kvcache.hashing import HASH_FUNCTIONS, ROOT_KEY, block_extra_keys, hash_block
from prefixkv.kvcache.manager import KVCacheManager


class HashPrefixCache(KVCacheManager):
    name = "hash"
    caching = True  # NoPrefixCache turns this off and keeps the same block pool

    def __init__(self, num_pages: int, page_size: int = 16, hash_algo: str = "sha256") -> None:
        super().__init__(num_pages, page_size)
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {hash_algo!r}")
        self.hash_algo = hash_algo
        self._hash_fn = HASH_FUNCTIONS[hash_algo]
        self.blocks = [Block(i) for i in range(num_pages)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_page_ids: dict[str, list[int]] = {}  # the same blocks' ids: page_table() runs every step
        self._req_num_committed: dict[str, int] = {}  # leading blocks of the request already keyed
        self.num_evictions = 0  # keys only leave the map on eviction: a memoised match stays valid until then
        self._hashes_key = ("block_hashes", page_size, hash_algo)  # request.cache_state keys
        self._match_key = ("match", id(self))

    # -- keys ----------------------------------------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first num_blocks full blocks, memoised on the request (token ids only grow)."""
        hashes: list[bytes] = request.cache_state.setdefault(self._hashes_key, [])
        bs = self.page_size
        tokens = request.token_ids
        parent = hashes[-1] if hashes else ROOT_KEY
        for i in range(len(hashes), num_blocks):
            extra = block_extra_keys(i, bs, request.lora_id, request.cache_salt, request.mm_hashes)
            parent = hash_block(self._hash_fn, parent, tokens[i * bs:(i + 1) * bs], extra)
            hashes.append(parent)
        return hashes

    # -- queries -------------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        if not self.caching:
            return 0
        max_blocks = (request.num_tokens - 1) // self.page_size  # the last token is always recomputed
        memo = request.cache_state.get(self._match_key)  # (num_evictions, matched blocks) from an earlier lookup
        n = memo[1] if memo is not None and memo[0] == self.num_evictions else 0
        n = min(n, max_blocks)
        cached = self.cached
        hashes = self.block_hashes(request, max_blocks)
        while n < max_blocks and hashes[n] in cached:
            n += 1
        request.cache_state[self._match_key] = (self.num_evictions, n)
        return n * self.page_size

    def page_table(self, request: Request) -> list[int]:
        return self._req_page_ids.get(request.request_id, [])

    def num_free_pages(self) -> int:
        return self.free_queue.num_free

    # -- changes -------------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        first_admission = blocks is None
        if first_admission:
            blocks = []
        hit_blocks: list[Block] = []
        if num_cached_tokens:
            keys = request.cache_state[self._hashes_key][: num_cached_tokens // self.page_size]
            hit_blocks = [self.cached[k] for k in keys]
        total_tokens = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = -(-total_tokens // self.page_size) - len(blocks) - len(hit_blocks)
        reclaimed = sum(1 for b in hit_blocks if b.ref_cnt == 0)  # free now, but this request will hold them
        if num_new_blocks > self.free_queue.num_free - reclaimed:
            return False

        for b in hit_blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        blocks.extend(hit_blocks)
        for _ in range(max(0, num_new_blocks)):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            blocks.append(b)
        ids = [] if first_admission else self._req_page_ids[rid]
        ids.extend(b.block_id for b in blocks[len(ids):])
        if first_admission:
            self._req_blocks[rid] = blocks
            self._req_page_ids[rid] = ids
            self._req_num_committed[rid] = len(hit_blocks)
            self.stats.record(request.num_tokens, num_cached_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens += num_cached_tokens
        return True

    def commit(self, request: Request) -> None:
        if not self.caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.page_size
        start = self._req_num_committed[rid]
        if num_full <= start:
            return
        blocks = self._req_blocks[rid]
        keys = self.block_hashes(request, num_full)
        for i in range(start, num_full):
            key = keys[i]
            if key not in self.cached:  # else another request computed the same block first; ours stays private
                blocks[i].block_hash = key
                blocks[i].cache_salt = request.cache_salt
                self.cached[key] = blocks[i]
        self._req_num_committed[rid] = num_full

    def free(self, request: Request) -> None:
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_page_ids.pop(request.request_id, None)
        self._req_num_committed.pop(request.request_id, None)
        if not blocks:
            return
        for b in reversed(blocks):  # tail first: chain ends are evicted before shared beginnings
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)  # holds nothing reusable: hand it out before any cached block
                else:
                    self.free_queue.append(b)

    def _evict(self, block: Block) -> None:
        key = block.block_hash
        if key is not None:
            if self.cached.get(key) is block:
                del self.cached[key]
                self.num_evictions += 1
            block.block_hash = None

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Drop every cached block no request holds (only those whose cache_salt passes salt_filter, when
        given); True when nothing of that is left cached."""
        for b in self.free_queue:
            if salt_filter is None or (b.block_hash is not None and salt_filter(b.cache_salt)):
                self._evict(b)
        if salt_filter is None:
            return not self.cached
        return not any(salt_filter(b.cache_salt) for b in self.cached.values())

    # -- introspection -------------------------------------------------------------------------------------
    def summary(self) -> dict:
        out = super().summary()
        out.update(
            block_size=self.page_size,
            hash_algo=self.hash_algo,
            cached_blocks=len(self.cached),
            cached_tokens=len(self.cached) * self.page_size,
            evictable_blocks=sum(1 for b in self.free_queue if b.block_hash is not None) if self.caching else 0,
            running_requests=len(self._req_blocks),
            by_namespace=self._by_namespace(),
        )
        return out

    def _by_namespace(self) -> list[dict]:
        """Cached tokens per cache_salt (tenant), largest first; the hash chain keeps no per-block hit count."""
        tokens: dict[str | None, int] = {}
        for b in self.cached.values():
            tokens[b.cache_salt] = tokens.get(b.cache_salt, 0) + self.page_size
        return [{"cache_salt": salt, "cached_tokens": n}
                for salt, n in sorted(tokens.items(), key=lambda kv: (-kv[1], str(kv[0])))]

    def check_invariants(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free count drifted"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(free) + len(in_use) == self.num_pages, f"{len(free)} free + {len(in_use)} in use != {self.num_pages}"
        assert all(b.ref_cnt == 0 for b in free), "a block with ref_cnt > 0 is in the free queue"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref_cnt"
        for key, b in self.cached.items():
            assert b.block_hash == key, f"cached key maps to {b!r} whose key differs"
        for rid, blocks in self._req_blocks.items():
            assert self._req_page_ids[rid] == [b.block_id for b in blocks], "page ids drifted from blocks"
        holders: dict[int, int] = {}
        for blocks in self._req_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.blocks:
            assert holders.get(b.block_id, 0) == b.ref_cnt, f"{b!r} ref_cnt != number of requests holding it"
