"""A prefix cache with a second tier behind it: what the pool has evicted (or a former process computed) is loaded
back from the tier instead of recomputed.

TieredKVCache wraps either prefix cache and speaks the same KVCacheManager protocol, so the scheduler is
unchanged: a lookup answers the pool's hit plus the chunks the tier holds after it, and the scheduler counts all
of it as cached. The copying itself is the engine's: each step it drains the loads (tier payloads to write into
pool slots before the forward pass) and the saves (pool slots to read into the tier after it). This module never
touches a tensor.

Units: a tier entry is one chunk of chunk_tokens tokens (a multiple of the page size), keyed by hashing.py's
chain over chunks, so the key names the whole prefix with its salt, adapter and multimodal inputs: one tenant's
lookup can never find another's chunk. A chunk is read and verified (tier.get) during lookup, before any token of
it is promised, into a per-request staging memo (bounded; dropped at admission or free()), so lookups of a waiting
request (every step, by every policy's ordering) read it once. With staging full, a chunk the tier holds is
promised unread and verified at admission; if it fails then, the admission is refused with nothing taken (as when
pages are short) and the next lookup stops before it. Either way a chunk that fails verification ends the hit
there and is recomputed, never served.

Prefetch: the engine calls prefetch(request) when a request arrives. A background thread then reads and verifies
the chunks the tier holds for it into its staging (within the same bound), while the engine goes on stepping;
a lookup that needs a chunk still being read waits for that read alone. A request that waits in the queue finds
its chunks read by the time it is admitted, and an idle engine loses nothing.

Read-ahead: read_ahead(sequence) starts the same background reads before any request exists (an agent session's
next turn, due when its announced pause ends: engine/agent_sessions.py). Having no request to belong to, those
reads are kept by chunk key (the chain key names the prefix, salt and adapter, so it is what the next turn's lookup
computes); the first request whose prefetch or lookup reaches such a key takes the read over as its own. They
count in the same staging bound, below any request's own staging: when a request needs room, the oldest reads
ahead are dropped first; whoever started them drops those never taken (drop_read_ahead: the session came back
with another prompt, ended, or is overdue).

Write policies. write_through: after each step, every newly completed full chunk the tier does not hold yet is
saved. write_back: such a chunk is only remembered (its pages), and saved when one of its pages is handed out
again by an allocation, i.e. when the pool evicts it; the engine reads those saves right after scheduling, before
any load or forward pass overwrites the pages (allocation is the only way a page is reused, and a reused page
keeps its old KV until then). save_all_pending() hands over the rest (the engine does at close(), so a restart
finds it). What a request wrote to the tier (commit()'s Inserted.tier, RequestOutput.cache_writes.tier) is what
its own commits queued: write_through's chunks; write_back's are stored later, at an eviction, for no request.

KV events (with the inner cache's events on): once a saved chunk is in the tier, a BlockStored for its pages with
the tier's medium ("CPU" host RAM, "DISK", "REMOTE" the shared store; events.TIER_MEDIUMS) joins the inner cache's
events (the pool's, medium "GPU"), so a router learns where a block can be loaded from, not only what a pool
holds. The writer thread adds them as each put lands (tier_stored); drain_events hands them over with the pool's.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field

from prefixkv.cache_miss import CacheMiss
from prefixkv.choices import KV_OFFLOAD_WRITE_POLICIES, check
from prefixkv.kvcache.events import BlockStored, KVCacheEvent, block_stored, tier_medium
from prefixkv.kvcache.hashing import extend_block_keys, hash_function
from prefixkv.kvcache.manager import Inserted, KVCacheManager, PrefixCacheStats, runs_of
from prefixkv.kvcache.offload.chained_tier import ChainedTier, shared_store
from prefixkv.kvcache.offload.tier import KVTier
from prefixkv.kvcache.retention import RetentionTable
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.request import Request

DEFAULT_STAGING_BYTES = 256 << 20


@dataclass(slots=True)
class LoadOp:
    """Write tokens [first_token, first_token + len(slots)) of a chunk payload into these pool token slots."""

    request: Request
    slots: list[int]
    payload: bytes
    first_token: int


@dataclass(slots=True)
class SaveOp:
    """Read the chunk in these pool token slots (chunk_tokens of them, in position order) into the tier."""

    key: bytes
    slots: list[int]
    event: BlockStored | None = None  # its pages' BlockStored (KV events on), medium set per tier that takes it


@dataclass(slots=True)
class TierHitStats:
    """What the tier saved the engine, for /metrics and benchmarks."""

    # tokens admitted as cached, re-admissions after preemption included (PrefixCacheStats has first ones only)
    hit_tokens: int = 0  # because the tier held them
    pool_hit_tokens: int = 0  # because the pool did
    loaded_chunks: int = 0
    loaded_bytes: int = 0  # payload bytes handed to the engine to write into the pool
    read_seconds: float = 0.0  # reading and verifying payloads from the tier (in lookups and admissions)
    failed_reads: int = 0  # chunks the tier held but could not give back verified: recomputed instead
    saved_chunks: int = 0  # chunks handed to the engine to save
    read_ahead_chunks: int = 0  # chunk reads read_ahead() started, before any request asked for them
    read_ahead_loaded_chunks: int = 0  # of those, loaded into the pool by the request that came for them
    read_ahead_dropped_chunks: int = 0  # of those, dropped unused (for room, or by drop_read_ahead)


@dataclass(slots=True)
class _TierState:
    """What the tiered cache knows about one request, from its first lookup to free()."""

    request: Request
    keys: list[bytes] = field(default_factory=list)  # chunk chain keys (token ids only grow: they stay valid)
    page_keys: list[bytes] = field(default_factory=list)  # page chain keys, for KV events (grown as keys are)
    staged: dict[int, bytes] = field(default_factory=dict)  # chunk index -> verified payload, until admission
    # chunk index -> a background read (prefetch) of (verified payload or None, seconds); its bytes are counted
    # in the staging bound from submission
    reading: dict[int, Future] = field(default_factory=dict)
    bad_from: int = 1 << 62  # first chunk that failed verification: no hit reaches it
    pool_hit: int = 0  # the last lookup's split of its answer
    tier_hit: int = 0
    loaded_chunks: range = range(0)  # chunks that came from the tier at admission: never saved back
    checked_chunks: int = 0  # leading full chunks already saved, remembered to save, or found in the tier
    ahead: set[int] = field(default_factory=set)  # chunks whose read it took over from read_ahead()


class TieredKVCache(KVCacheManager):
    """`inner` (a hash or radix prefix cache) plus `tier`: a decorator of the KVCacheManager interface. lookup,
    allocate, commit and free add the tier to the inner cache's answers; everything else (the pool, its stats,
    retention and events, the views) is the inner cache's, forwarded."""

    reads_ahead = True

    def __init__(
        self,
        inner: KVCacheManager,
        tier: KVTier,
        chunk_tokens: int = 256,
        hash_algo: str = "sha256",
        write_policy: str = "write_through",
        max_staged_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        if not inner.caching:
            raise ValueError("a KV offload tier needs a prefix cache (prefix_cache 'hash' or 'radix', not 'off')")
        if chunk_tokens < 1 or chunk_tokens % inner.page_size:
            raise ValueError(
                f"kv_offload_chunk_tokens must be a positive multiple of page_size={inner.page_size}, "
                f"got {chunk_tokens}"
            )
        hash_fn = hash_function(hash_algo)
        check("kv_offload_write_policy", write_policy, KV_OFFLOAD_WRITE_POLICIES)
        if tier.manifest.chunk_tokens != chunk_tokens or tier.manifest.hash_algo != hash_algo:
            raise ValueError(
                f"the tier stores {tier.manifest.chunk_tokens}-token chunks keyed by {tier.manifest.hash_algo}, "
                f"the cache asks for {chunk_tokens}-token chunks keyed by {hash_algo}"
            )
        self.inner = inner
        self.tier = tier
        self.name = inner.name
        self.chunk_tokens = chunk_tokens
        self.hash_algo = hash_algo
        self.write_policy = write_policy
        self.max_staged_bytes = max_staged_bytes
        self.tier_stats = TierHitStats()
        self._hash_fn = hash_fn
        self._states: dict[str, _TierState] = {}  # by request id
        self._staged_bytes = 0
        self._loads: list[LoadOp] = []
        self._saves: list[SaveOp] = []
        # write_back: chunks computed but not in the tier (key -> their pool slots), and which page holds which
        self._unsaved: dict[bytes, list[int]] = {}
        self._unsaved_by_page: dict[int, bytes] = {}
        self._unsaved_events: dict[bytes, BlockStored] = {}  # write_back with KV events: their BlockStored
        # the tiers a save goes to, each with its medium in KV events (a local tier and the store: both)
        parts: list[KVTier] = [tier.local, tier.store] if isinstance(tier, ChainedTier) else [tier]
        self._media = [(tier_medium(part.name), part) for part in parts]
        self._store = shared_store(tier)  # the shared store among them, if any (its state explains misses)
        self._tier_events: deque[KVCacheEvent] = deque()  # appended by the writer thread, drained by the engine's
        self._prefetcher: ThreadPoolExecutor | None = None  # started by the first prefetch()
        # read_ahead(): chunk key -> its background read (as in _TierState.reading), oldest first
        self._ahead: OrderedDict[bytes, Future] = OrderedDict()

    @property
    def keys_in_flight_pages(self) -> bool:  # type: ignore[override]
        """The inner cache's: pages loaded from the tier are keyed when the inner cache keys computed ones."""
        return self.inner.keys_in_flight_pages

    # the pool and what is kept about it are the inner cache's (retained pages too: the inner cache honours
    # them); read-only here, where the interface declares attributes: nothing assigns them after construction
    @property
    def num_pages(self) -> int:  # type: ignore[override]
        return self.inner.num_pages

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.inner.page_size

    @property
    def stats(self) -> PrefixCacheStats:  # type: ignore[override]
        return self.inner.stats

    @property
    def retention(self) -> RetentionTable:  # type: ignore[override]
        return self.inner.retention

    # -- per-request state ---------------------------------------------------------------------------------
    def _state(self, request: Request) -> _TierState:
        state = self._states.get(request.request_id)
        if state is None or state.request is not request:
            if state is not None:
                self._unstage(state)
            state = self._states[request.request_id] = _TierState(request)
        return state

    def _chunk_keys(self, state: _TierState, num_chunks: int) -> list[bytes]:
        if len(state.keys) >= num_chunks:
            return state.keys
        r = state.request
        return extend_block_keys(
            state.keys, r.token_ids, self.chunk_tokens, num_chunks, self._hash_fn, r.lora_id, r.cache_salt, r.mm_hashes
        )

    def _page_keys(self, state: _TierState, num_pages: int) -> list[bytes]:
        """The request's page chain keys, extended from where the last commit left them (each page hashed once)."""
        if len(state.page_keys) >= num_pages:
            return state.page_keys
        r = state.request
        return extend_block_keys(
            state.page_keys, r.token_ids, self.page_size, num_pages, self._hash_fn, r.lora_id, r.cache_salt, r.mm_hashes
        )

    def _unstage(self, state: _TierState, below: int | None = None) -> None:
        """Drop the request's staged payloads and reads in flight (only those of chunks below `below`, when
        given); a read in flight finishes unused."""
        if not state.staged and not state.reading:  # the usual case: every waiting request's lookup comes here
            return
        for c in [c for c in state.staged if below is None or c < below]:
            self._staged_bytes -= len(state.staged.pop(c))
        for c in [c for c in state.reading if below is None or c < below]:
            state.reading.pop(c).cancel()
            self._staged_bytes -= self.tier.manifest.payload_bytes
        state.ahead.difference_update([c for c in state.ahead if below is None or c < below])

    # -- prefetch ------------------------------------------------------------------------------------------
    def prefetch(self, request: Request) -> None:
        """Start reading, in the background, the chunks the tier holds after the pool's hit for this new request
        (while staging has room); lookups then take them from staging instead of reading them themselves."""
        state = self._state(request)
        c, size = self.chunk_tokens, self.tier.manifest.payload_bytes
        index = self.inner.lookup(request) // c
        max_chunks = (request.num_tokens - 1) // c
        keys = self._chunk_keys(state, max_chunks)
        if self._ahead:  # take over what was read ahead for it (what the pool holds again is let go)
            for i, key in enumerate(keys[:max_chunks]):
                if i < index and key in self._ahead:
                    self._drop_ahead(key)
                elif i >= index:
                    self._adopt(state, i, key)
        while index < max_chunks and self._make_room(size):
            if index not in state.staged and index not in state.reading:
                if not self.tier.contains(keys[index]):
                    break
                state.reading[index] = self._submit(keys[index])
                self._staged_bytes += size
            index += 1

    def _submit(self, key: bytes) -> Future:
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix=f"prefixkv-{self.tier.name}-prefetch")
        return self._prefetcher.submit(self._timed_get, key)

    def _make_room(self, size: int, keep: bytes | None = None) -> bool:
        """Whether `size` more staged bytes fit the bound, once the oldest reads ahead are dropped if need be (a
        request in hand comes before a guess about one); `keep`: a read ahead not to drop (nor any after it)."""
        while self._staged_bytes + size > self.max_staged_bytes and self._ahead:
            oldest = next(iter(self._ahead))
            if oldest == keep:
                return False
            self._drop_ahead(oldest)
        return self._staged_bytes + size <= self.max_staged_bytes

    # -- read-ahead, before the request exists -------------------------------------------------------------
    def read_ahead(self, request: Request) -> int:
        """Start reading, in the background, the chunks of request.token_ids the tier holds after the pool's hit
        (whole chunks below its last token, as a lookup of it would load), kept by chunk key for a request yet to
        come; within the staging bound, dropping older reads ahead for room. Returns how many reads it started."""
        c, size = self.chunk_tokens, self.tier.manifest.payload_bytes
        keys = self._sequence_keys(request, (request.num_tokens - 1) // c)
        started = 0
        first: bytes | None = None  # this sequence's oldest read ahead: room is never made by dropping its own
        for key in keys[self.inner.lookup(request) // c :]:
            if key in self._ahead:
                self._ahead.move_to_end(key)
            else:
                if not self.tier.contains(key) or not self._make_room(size, keep=first):
                    break
                self._ahead[key] = self._submit(key)
                self._staged_bytes += size
                started += 1
            first = first or key
        self.tier_stats.read_ahead_chunks += started
        return started

    def drop_read_ahead(self, request: Request, keep_tokens: int = 0) -> int:
        """Drop the reads ahead of request.token_ids' chunks not yet taken by a request, except those wholly
        inside its first keep_tokens tokens (a request that extends them is about to take them). Returns how
        many were dropped."""
        if not self._ahead:
            return 0
        c = self.chunk_tokens
        dropped = 0
        for key in self._sequence_keys(request, (request.num_tokens - 1) // c)[keep_tokens // c :]:
            if key in self._ahead:
                self._drop_ahead(key)
                dropped += 1
        return dropped

    def expected_read_seconds(self, num_tokens: int) -> float:
        """Reading num_tokens' whole chunks one after another (one prefetch thread) at the tier's measured read
        rate so far; 0 before its first read."""
        stats = self.tier.stats
        if not stats.bytes_read:
            return 0.0
        seconds_per_byte = stats.read_seconds / stats.bytes_read
        return num_tokens // self.chunk_tokens * self.tier.manifest.payload_bytes * seconds_per_byte

    def _adopt(self, state: _TierState, index: int, key: bytes) -> None:
        """Chunk `index` of the request was read ahead under `key`: the read becomes the request's own."""
        future = self._ahead.pop(key, None)
        if future is None:
            return
        if index in state.staged or index in state.reading:  # read twice: the request's own read stands
            self._release_ahead(future)
            return
        state.reading[index] = future
        state.ahead.add(index)

    def _drop_ahead(self, key: bytes) -> None:
        self._release_ahead(self._ahead.pop(key))

    def _release_ahead(self, future: Future) -> None:
        future.cancel()  # a read already running finishes unused
        self._staged_bytes -= self.tier.manifest.payload_bytes
        self.tier_stats.read_ahead_dropped_chunks += 1

    def wait_reads(self) -> None:
        """Wait for the background reads started so far (prefetches and reads ahead) to finish."""
        futures = [*self._ahead.values(), *(f for state in self._states.values() for f in state.reading.values())]
        wait_for(futures)

    def _timed_get(self, key: bytes) -> tuple[bytes | None, float]:
        started = time.perf_counter()
        payload = self.tier.get(key)
        return payload, time.perf_counter() - started

    def _take_read(self, state: _TierState, index: int) -> bytes | None:
        """The prefetched payload of chunk `index`, waiting for its read if it is still running; staged when it
        verified (its bytes were counted at submission), released when it did not."""
        payload = self._verified(*state.reading.pop(index).result())
        if payload is None:
            self._staged_bytes -= self.tier.manifest.payload_bytes
            state.bad_from = min(state.bad_from, index)
            return None
        state.staged[index] = payload
        return payload

    def close(self) -> None:
        """Stop the prefetch thread (reads in flight finish; their results are dropped)."""
        for state in self._states.values():
            self._unstage(state)
        for key in list(self._ahead):
            self._drop_ahead(key)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None

    def _probe(self, state: _TierState, index: int) -> bool:
        """Whether chunk `index` can be promised. While staging has room it is read and verified now (and staged,
        so later lookups of the waiting request read nothing); with staging full, the tier holding it is enough
        and admission verifies it (_take_payloads). False when the tier lacks it or it failed verification."""
        if self._ahead:
            self._adopt(state, index, self._chunk_keys(state, index + 1)[index])
        if index in state.reading:
            return self._take_read(state, index) is not None
        key = self._chunk_keys(state, index + 1)[index]
        if not self.tier.contains(key):
            return False
        size = self.tier.manifest.payload_bytes
        if not self._make_room(size):
            return True
        payload = self._read(key)
        if payload is None:
            state.bad_from = index
            return False
        state.staged[index] = payload
        self._staged_bytes += size
        return True

    def _read(self, key: bytes) -> bytes | None:
        """The verified payload under key, read now (None, counted, when the tier cannot give it back intact)."""
        return self._verified(*self._timed_get(key))

    def _verified(self, payload: bytes | None, seconds: float) -> bytes | None:
        """A read's payload if it is whole (None, counted, if not); its time goes into the stats either way."""
        self.tier_stats.read_seconds += seconds
        if payload is None or len(payload) != self.tier.manifest.payload_bytes:
            self.tier_stats.failed_reads += 1
            return None
        return payload

    def _take_payloads(self, state: _TierState, chunks: range) -> dict[int, bytes] | None:
        """The payloads of these chunks: staged ones, the others read and verified now. None when one fails (the
        hit then ends before it at the next lookup)."""
        payloads = {}
        keys = self._chunk_keys(state, chunks.stop)
        for index in chunks:
            payload = state.staged.get(index)
            if payload is None and self._ahead:
                self._adopt(state, index, keys[index])
            if payload is None and index in state.reading:
                payload = self._take_read(state, index)
            elif payload is None:
                payload = self._read(keys[index])
            if payload is None:
                state.bad_from = index
                return None
            payloads[index] = payload
        return payloads

    # -- the protocol ----------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """The pool's hit, then whole chunks from the tier while it has them verified, up to the last chunk
        boundary before the last token (a hit never includes it)."""
        pool_hit = self.inner.lookup(request)
        state = self._state(request)
        c = self.chunk_tokens
        first = pool_hit // c
        self._unstage(state, below=first)  # chunks the pool now covers whole
        end = first
        max_chunks = (request.num_tokens - 1) // c
        while end < min(max_chunks, state.bad_from) and (end in state.staged or self._probe(state, end)):
            end += 1
        state.pool_hit, state.tier_hit = pool_hit, max(0, end * c - pool_hit)
        return pool_hit + state.tier_hit

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """At first admission, take the pool part of the hit from the inner cache and allocate the tier part as
        new tokens, then queue its loads (the inner cache keys those pages as if computed: the hash cache at once,
        in flight, the radix cache at commit; the engine writes the loads before the forward pass either way)."""
        if not num_cached_tokens:
            held = len(self.inner.page_table(request))
            if not self.inner.allocate(request, num_new_tokens):
                return False
            self._pages_reused(self.inner.page_table(request)[held:])
            return True
        state = self._states.get(request.request_id)
        if state is None or state.request is not request or state.pool_hit + state.tier_hit != num_cached_tokens:
            self.lookup(request)
            state = self._states[request.request_id]
        pool_part = min(state.pool_hit, num_cached_tokens)
        tier_part = num_cached_tokens - pool_part
        if tier_part > state.tier_hit:
            found = state.pool_hit + state.tier_hit
            raise ValueError(f"{num_cached_tokens} cached tokens asked, a lookup finds {found}")
        chunks = range(pool_part // self.chunk_tokens, -(-num_cached_tokens // self.chunk_tokens))
        payloads = self._take_payloads(state, chunks) if tier_part else {}
        if payloads is None:  # a chunk promised unread failed verification: nothing taken, the next lookup stops
            return False  # before it (the scheduler retries next step, as when pages are short)
        if not self.inner.allocate(request, num_new_tokens + tier_part, pool_part):
            return False
        self._pages_reused(self.inner.page_table(request)[pool_part // self.page_size :])
        self.tier_stats.pool_hit_tokens += pool_part
        if tier_part:
            self._queue_loads(payloads, request, pool_part, num_cached_tokens)
            self.tier_stats.read_ahead_loaded_chunks += len(state.ahead.intersection(payloads))
        state.loaded_chunks = chunks
        self._unstage(state)
        return True

    def _queue_loads(self, payloads: dict[int, bytes], request: Request, start: int, end: int) -> None:
        c, ps = self.chunk_tokens, self.page_size
        pages = self.inner.page_table(request)
        pos = start
        while pos < end:
            index = pos // c
            stop = min((index + 1) * c, end)
            slots = [pages[p // ps] * ps + p % ps for p in range(pos, stop)]
            self._loads.append(LoadOp(request, slots, payloads[index], pos - index * c))
            self.tier_stats.loaded_chunks += 1
            self.tier_stats.loaded_bytes += (stop - pos) * self.tier.manifest.bytes_per_token
            pos = stop
        self.tier_stats.hit_tokens += end - start

    def commit(self, request: Request) -> Inserted:
        """The inner cache keys the new pages; then every newly completed chunk the tier lacks is queued to save.

        What this request wrote to the tier is what it queued here (write_through): chunks it computed that the
        tier held nowhere (not stored, not queued, not waiting for an eviction), counted when handed over, as the
        pool's pages are when inserted (the writer thread stores them right after; a save its full queue drops
        costs a later recompute, and is still counted). With write_back a chunk is stored when the pool evicts
        it, later and for no request: a request's tier writes are then none."""
        pool = self.inner.commit(request)
        state = self._state(request)
        c = self.chunk_tokens
        full = request.num_computed_tokens // c
        if full <= state.checked_chunks:
            return pool
        keys = self._chunk_keys(state, full)
        pages = self.inner.page_table(request)
        ps = self.page_size
        queued = {save.key for save in self._saves}
        page_keys: list[bytes] | None = None  # the pages' chain keys, for KV events (extended once per commit)
        saved = []
        for index in range(state.checked_chunks, full):
            key = keys[index]
            if index in state.loaded_chunks or key in queued or key in self._unsaved or self.tier.contains(key):
                continue
            slots = [pages[p // ps] * ps + p % ps for p in range(index * c, (index + 1) * c)]
            event = None
            if self.inner.events_enabled:
                if page_keys is None:
                    page_keys = self._page_keys(state, full * c // ps)
                event = block_stored(request, page_keys, index * c // ps, (index + 1) * c // ps, ps)
            if self.write_policy == "write_back":
                self._unsaved[key] = slots
                if event is not None:
                    self._unsaved_events[key] = event
                for page in pages[index * c // ps : (index + 1) * c // ps]:
                    self._unsaved_by_page[page] = key
            else:
                self._save(key, slots, event)
                saved.append(index)
        state.checked_chunks = full
        return Inserted(pool.pool, self.page_size, runs_of(saved, c), c) if saved else pool

    def _save(self, key: bytes, slots: list[int], event: BlockStored | None = None) -> None:
        self._saves.append(SaveOp(key, slots, event))
        self.tier_stats.saved_chunks += 1

    def tier_stored(self, save: SaveOp) -> None:
        """The writer thread has put `save` into the tier: its BlockStored, once per tier that now holds it."""
        if save.event is None:
            return
        for medium, part in self._media:
            if part.contains(save.key):
                self._tier_events.append(dataclasses.replace(save.event, medium=medium))

    def _pages_reused(self, pages: list[int]) -> None:
        """write_back: pages an allocation just handed out will be overwritten: save the chunks they hold now."""
        if not self._unsaved_by_page:
            return
        for page in pages:
            key = self._unsaved_by_page.get(page)
            if key is not None:
                self._save_unsaved(key)

    def _save_unsaved(self, key: bytes) -> None:
        slots = self._unsaved.pop(key)
        ps = self.page_size
        for page in {slot // ps for slot in slots}:
            if self._unsaved_by_page.get(page) == key:
                del self._unsaved_by_page[page]
        self._save(key, slots, self._unsaved_events.pop(key, None))

    def save_all_pending(self) -> None:
        """write_back: queue every chunk not saved yet (at shutdown: what the pool still holds goes to the tier)."""
        for key in list(self._unsaved):
            self._save_unsaved(key)

    def demote(self, request: Request) -> int:
        """write_back: queue the saves of the sequence's computed chunks the tier lacks, now rather than at their
        eviction (write_through saved them at commit already)."""
        if not self._unsaved:
            return 0
        keys = self._sequence_keys(request, len(request.token_ids) // self.chunk_tokens)
        demoted = [key for key in keys if key in self._unsaved]
        for key in demoted:
            self._save_unsaved(key)
        return len(demoted)

    def readable_chunks(self, request: Request) -> list[bytes]:
        """The keys of the chunks after the pool's hit that the tier holds, in order up to the first it lacks:
        what a lookup of request.token_ids would load (a simulated tier reads them ahead, sim/tier.py)."""
        c = self.chunk_tokens
        first = self.inner.lookup(request) // c
        keys = self._sequence_keys(request, (len(request.token_ids) - 1) // c)
        out = []
        for key in keys[first:]:
            if not self.tier.contains(key):
                break
            out.append(key)
        return out

    def _sequence_keys(self, request: Request, num_chunks: int) -> list[bytes]:
        """Chunk keys of request.token_ids without keeping per-request state (a probe's, or a finished one's)."""
        r = request
        return extend_block_keys(
            [], r.token_ids, self.chunk_tokens, num_chunks, self._hash_fn, r.lora_id, r.cache_salt, r.mm_hashes
        )

    def explain_miss(self, request: Request, num_cached_tokens: int) -> CacheMiss | None:
        """The inner cache's listener, past the whole hit (pool and tier): a page the pool evicted and the tier
        could not serve reads as evicted; with the shared store down now, such pages read as store_down."""
        miss = self.inner.explain_miss(request, num_cached_tokens)
        if miss is not None and self._store is not None and self._store.down_reason is not None:
            return miss.with_store_down()
        return miss

    def free(self, request: Request) -> None:
        self.inner.free(request)
        state = self._states.pop(request.request_id, None)
        if state is not None:
            self._unstage(state)
        if any(load.request is request for load in self._loads):  # preempted before its step ran
            self._loads = [load for load in self._loads if load.request is not request]

    def drain_loads(self) -> list[LoadOp]:
        """Payloads to write into the pool before this step's forward pass (the scheduled requests read them)."""
        loads, self._loads = self._loads, []
        return loads

    def drain_saves(self) -> list[SaveOp]:
        """Chunks to read out of the pool now, before a load or a forward pass can overwrite their pages (after
        scheduling, for write_back's evictions, and after each step)."""
        saves, self._saves = self._saves, []
        return saves

    # -- everything else is the inner cache's ------------------------------------------------------------------
    def page_table(self, request: Request) -> list[int]:
        return self.inner.page_table(request)

    def num_free_pages(self) -> int:
        return self.inner.num_free_pages()

    def num_cached_pages(self) -> int:
        return self.inner.num_cached_pages()

    def pages_needed(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> int:
        return self.inner.pages_needed(request, num_new_tokens, num_cached_tokens)

    def enable_events(self) -> None:
        self.inner.enable_events()

    @property
    def events_enabled(self) -> bool:
        return self.inner.events_enabled

    def drain_events(self) -> list[KVCacheEvent]:
        """The pool's events, then the tiers' (BlockStored with the tier's medium) that landed since the last
        drain."""
        events = self.inner.drain_events()
        while self._tier_events:
            events.append(self._tier_events.popleft())
        return events

    def cached_block_hashes(self) -> set[int]:
        return self.inner.cached_block_hashes()

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Resets the pool only: the tier is the durable copy (a disk tier is emptied by deleting its files)."""
        return self.inner.reset_prefix_cache(salt_filter)

    def retain_cached(self, request: Request, seconds: float, priority: int = 0) -> int:
        """The pool's pages only: the tier keeps no retention of its own."""
        return self.inner.retain_cached(request, seconds, priority)

    def release_retention(self, request: Request, keep_tokens: int = 0) -> int:
        """The pool's retention only: the tier keeps no retention of its own."""
        return self.inner.release_retention(request, keep_tokens)

    def prefix_path(self, request: Request) -> list[Hashable]:
        return self.inner.prefix_path(request)

    def render_tree(
        self, tokenizer_decode: Callable[[list[int]], str] | None = None, max_depth: int = 3, max_children: int = 5
    ) -> str:
        return self.inner.render_tree(tokenizer_decode, max_depth, max_children)

    def summary(self) -> CacheSummary:
        out = self.inner.summary()
        t, s = self.tier, self.tier_stats
        out.details["tier"] = {
            "name": t.name,
            "chunk_tokens": self.chunk_tokens,
            "write_policy": self.write_policy,
            "capacity_bytes": t.capacity_bytes,
            "entries": t.stats.entries,
            "bytes": t.stats.bytes,
            "corrupt": t.stats.corrupt,
            "hit_tokens": s.hit_tokens,
            "loaded_bytes": s.loaded_bytes,
            "saved_chunks": s.saved_chunks,
        }
        return out

    def check_invariants(self) -> None:
        self.inner.check_invariants()
        staged = sum(len(p) for state in self._states.values() for p in state.staged.values())
        reading = sum(len(state.reading) for state in self._states.values()) + len(self._ahead)
        staged += reading * self.tier.manifest.payload_bytes
        assert staged == self._staged_bytes, f"staged bytes {self._staged_bytes} != {staged} held or being read"
        assert self._staged_bytes <= self.max_staged_bytes, "staging over its bound"
        for load in self._loads:
            pages = set(self.inner.page_table(load.request))
            assert all(slot // self.page_size in pages for slot in load.slots), "a load into pages not its own"
        for save in self._saves:
            assert len(save.slots) == self.chunk_tokens, "a save of a partial chunk"
        for key, slots in self._unsaved.items():
            assert all(self._unsaved_by_page.get(slot // self.page_size) == key for slot in slots), "unsaved pages"
        assert set(self._unsaved_by_page.values()) <= set(self._unsaved), "a page of a chunk no longer unsaved"
