"""The one interface the scheduler sees for KV memory, whichever prefix cache (or none) sits behind it.

Protocol per request (all called by the scheduler, never by the model runner):
  lookup(req)                 -> tokens a hit would cover now (no effect on the pool, used for ordering and sizing)
  allocate(req, n, cached)    -> take the `cached` hit's pages (first admission only), then pages for n more
                                 tokens; False and nothing changed if memory is short even after eviction
  page_table(req)             -> page ids, handed to the model runner
  commit(req)                 -> req.num_computed_tokens advanced: make newly computed KV findable; returns what
                                 this request inserted itself (Inserted: the scheduler records its writes)
  free(req)                   -> finished, aborted or preempted: release pages (they stay cached until evicted;
                                 pages keyed in flight that were never computed are forgotten)

KV events (events.py), off by default: after enable_events() every page that becomes findable, every eviction
and every reset is recorded, and drain_events() hands the records over (the engine publishes them once a step).
Off, a store or an eviction costs one `if`.

The manager never writes a request: the scheduler owns its progress (it sets num_computed_tokens after a
successful allocate and advances it after each step) and records the admissions in `stats`. What a manager
remembers per request (pages, memoised keys and matches) lives inside the manager, typed, until free().
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from prefixkv.cache_miss import CacheMiss
from prefixkv.kvcache.events import AllBlocksCleared, KVCacheEvent
from prefixkv.kvcache.miss_reasons import MissExplainer
from prefixkv.kvcache.retention import RetentionTable
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.request import Request, Span


@dataclass(frozen=True, slots=True)
class Inserted:
    """What one commit() made cacheable on its request's behalf, as the cache's own inserts reported it: runs
    [start, end) of the request's sequence, of whole pages it inserted into the prefix cache that were not cached
    before (never one another request had cached first, in flight or earlier), and of whole chunks it handed to a
    second tier to store. The scheduler keeps the prompt's part in Request.cache_writes (units wholly inside the
    prompt: hence the unit sizes)."""

    pool: tuple[Span, ...] = ()
    page_size: int = 1
    tier: tuple[Span, ...] = ()
    chunk_tokens: int = 1


NOTHING_INSERTED = Inserted()


def runs_of(indices: list[int], size: int) -> tuple[Span, ...]:
    """The token runs of these pages (or chunks) of `size` tokens, ascending indices: consecutive ones joined."""
    if indices[-1] - indices[0] + 1 == len(indices):  # the usual case: one run
        return ((indices[0] * size, (indices[-1] + 1) * size),)
    runs: list[Span] = []
    for i in indices:
        if runs and runs[-1][1] == i * size:
            runs[-1] = (runs[-1][0], (i + 1) * size)
        else:
            runs.append((i * size, (i + 1) * size))
    return tuple(runs)


@dataclass(slots=True)
class PrefixCacheStats:
    """Admissions and their hits, in prompt tokens. The hit rate counts first admissions only (as vLLM does):
    a request re-admitted after preemption finds its own earlier pages again, and counting that would let the
    rate exceed what any schedule could reach. Re-admissions are counted apart."""

    queries: int = 0  # prompt tokens looked up at first admission
    hits: int = 0  # of those, tokens served from the cache
    requests: int = 0
    readmission_queries: int = 0  # tokens looked up when a preempted request came back
    readmission_hits: int = 0
    readmissions: int = 0
    evicted_pages: int = 0  # cached pages dropped to make room or by a reset (counted by the manager itself)
    # missed prompt tokens of first admissions by cause (cache_miss.py); they sum to queries - hits
    missed_by_cause: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record_miss(self, miss: CacheMiss) -> None:
        for cause, tokens in miss.tokens_by_cause.items():
            self.missed_by_cause[cause] = self.missed_by_cause.get(cause, 0) + tokens

    def record(self, num_tokens: int, num_hit: int, readmission: bool = False) -> None:
        if readmission:
            self.readmissions += 1
            self.readmission_queries += num_tokens
            self.readmission_hits += num_hit
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hit


class KVCacheManager(ABC):
    """Pages of `page_size` token slots from one pool of `num_pages`; the runner maps slot = page * page_size + i.

    The interface only: no state. The prefix caches (hash, radix, off) share theirs through PagedKVCache below;
    a decorator such as the second tier's TieredKVCache implements the interface over an inner cache."""

    name: str = "abstract"
    caching: bool = True  # False: lookup never finds anything (prefix caching off), so waiting for a page gains nothing
    # True: allocate() makes the full pages a chunk completes findable at once ("keyed before computed"), so a
    # request admitted later in the same step hits them (the forward pass writes them before anyone attends).
    # False: pages become findable at commit(), after their step; the scheduler then defers the duplicate instead.
    keys_in_flight_pages: bool = False
    reads_ahead: bool = False  # True: read_ahead() stages a second tier's chunks for a request yet to come
    num_pages: int
    page_size: int
    stats: PrefixCacheStats  # written by the scheduler at admission; the manager only reports it
    retention: RetentionTable  # pages kept past their last use (retention.py)

    # -- KV events -------------------------------------------------------------------------------------------
    @abstractmethod
    def enable_events(self) -> None:
        """Start recording KV events. Call it before the first request: a subscriber learns only what was stored
        after this."""

    @property
    @abstractmethod
    def events_enabled(self) -> bool: ...

    @abstractmethod
    def drain_events(self) -> list[KVCacheEvent]:
        """The events since the last drain, oldest first (empty when events are off)."""

    def cached_block_hashes(self) -> set[int]:
        """Hashes (as events name them) of every page a lookup can find now: what a subscriber that applied every
        event since enable_events() must hold."""
        return set()

    # -- queries -------------------------------------------------------------------------------------------
    @abstractmethod
    def lookup(self, request: Request) -> int:
        """Tokens of request.token_ids whose KV is cached and usable (< request.num_tokens). No side effects."""

    @abstractmethod
    def page_table(self, request: Request) -> list[int]:
        """Page ids holding the request's KV, in position order. The manager's own list (it runs every step):
        read it, don't keep or change it."""

    @abstractmethod
    def num_free_pages(self) -> int:
        """Pages an allocation could get now: free plus evictable cached ones."""

    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages()

    def num_cached_pages(self) -> int:
        """Pages a lookup can find now (in use or evictable)."""
        return 0

    def usage(self) -> float:
        return self.num_used_pages() / self.num_pages

    def pages_needed(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> int:
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        return -(-total // self.page_size)

    # -- changes -------------------------------------------------------------------------------------------
    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Take the hit's pages (num_cached_tokens, a lookup() result, at first admission only) and reserve pages
        up to request.num_computed_tokens + num_cached_tokens + num_new_tokens. Writes nothing on the request:
        the scheduler counts the hit as computed once this returns True."""

    @abstractmethod
    def commit(self, request: Request) -> Inserted:
        """Called after a forward pass advanced request.num_computed_tokens; returns what this request inserted
        itself (NOTHING_INSERTED when nothing)."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's pages; computed KV stays in the cache where the cache keeps it."""

    def explain_miss(self, request: Request, num_cached_tokens: int) -> CacheMiss | None:
        """Why the request's prompt past its hit (num_cached_tokens, at first admission) was not served from the
        cache (miss_reasons.py); None without a prefix cache."""
        return None

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Drop cached KV no running request holds (with salt_filter: only the namespaces whose cache_salt it
        accepts, i.e. one tenant's). False when some request still holds pages of what was to go."""
        return True

    def retain_cached(self, request: Request, seconds: float, priority: int = 0) -> int:
        """Retain now, for `seconds` at `priority`, the cached pages of request.token_ids' prefix (whole pages,
        never the last token's): a pin set between requests, e.g. when an agent's turn ends and its tool runs
        (sim/sessions.py). A page already retained keeps the stronger retention; the retention cap applies.
        Returns how many pages were retained. No effect on the request."""
        return 0

    def release_retention(self, request: Request, keep_tokens: int = 0) -> int:
        """End now the retention of the cached pages of request.token_ids' prefix (whole pages, never the last
        token's) that lie past its first `keep_tokens` tokens (a page wholly inside them stays retained: another
        retained prefix still needs it). The pages stay cached as ordinary ones. Returns how many were released.
        No effect on the request; a cache without retained pages releases nothing."""
        return 0

    def demote(self, request: Request) -> int:
        """Hand the second tier, now, the cached chunks of request.token_ids it does not hold yet (an agent's turn
        ended and its tool runs: the pool may evict them later at no cost). Returns how many chunks were queued; a
        cache without a tier (or one that saved them already) queues none."""
        return 0

    def read_ahead(self, request: Request) -> int:
        """Start reading back, in the background, the chunks of request.token_ids that only the second tier holds
        now, for a later request to find read (an agent's next turn, before its announced pause ends). Returns how
        many chunk reads were started; a cache without a tier starts none."""
        return 0

    def drop_read_ahead(self, request: Request, keep_tokens: int = 0) -> int:
        """Drop what read_ahead(request) read and no request took, past its first keep_tokens tokens (whole
        chunks). Returns how many chunks were dropped."""
        return 0

    def expected_read_seconds(self, num_tokens: int) -> float:
        """How long read_ahead of num_tokens tokens is expected to take, at the tier's measured rate (0 without a
        tier, or before anything was read from it)."""
        return 0.0

    def summary(self) -> CacheSummary:
        """The cache's view of itself for humans (CLI, admin endpoint); caches add what they hold."""
        return CacheSummary(
            type=self.name,
            num_pages=self.num_pages,
            page_size=self.page_size,
            free_pages=self.num_free_pages(),
            queries=self.stats.queries,
            hits=self.stats.hits,
            hit_rate=self.stats.hit_rate,
            readmission_queries=self.stats.readmission_queries,
            readmission_hits=self.stats.readmission_hits,
            evicted_pages=self.stats.evicted_pages,
            **self.retention.summary(),
        )

    # -- optional views (defaults for caches that have nothing to show) ----------------------------------------
    def prefix_path(self, request: Request) -> list[Hashable]:
        """Hashable ids of the request's cached prefix, root side first; equal ids mean an equal cached prefix
        (dfs-weight lays the waiting queue out on these). Empty without a cache."""
        return []

    def render_tree(
        self, tokenizer_decode: Callable[[list[int]], str] | None = None, max_depth: int = 3, max_children: int = 5
    ) -> str:
        """The top of the cache's tree as text; ValueError for caches that are not a tree."""
        raise ValueError(f"the {self.name!r} prefix cache has no tree to render; use prefix_cache='radix'")

    def check_invariants(self) -> None:  # noqa: B027 - optional: a manager with no accounting has nothing to check
        """Raise AssertionError when the accounting is broken (tests call this after every operation)."""


class PagedKVCache(KVCacheManager):
    """What every prefix cache over its own pool keeps: the pool's size, the retention table, the admission
    stats, the KV event buffer and the miss listener (the hash, radix and off caches derive from it)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        retained_pool_fraction: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        miss_history: int | None = None,
    ) -> None:
        """retained_pool_fraction: the most of the pool that retained pages (retention.py) may hold; clock: what
        retention deadlines and eviction times are measured on (a simulation passes its simulated clock);
        miss_history: evicted pages remembered to explain misses (default 8x the pool, at least 4,096; the
        simulator passes -1: all of them)."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.retention = RetentionTable(num_pages, retained_pool_fraction, clock)
        self.stats = PrefixCacheStats()
        self._events: list[KVCacheEvent] | None = None  # None: events off
        if miss_history is None:
            miss_history = max(8 * num_pages, 4096)
        self.misses = MissExplainer(page_size, clock, None if miss_history < 0 else miss_history)
        self._on_invalid_pages: Callable[[list[int]], None] | None = None

    def watch_invalid_pages(self, callback: Callable[[list[int]], None] | None) -> None:
        """callback(pages) each time pages stop holding KV anyone may read: handed to a new owner (until it writes
        them), evicted from the cache, or freed uncached. The debug mode debug_nan_kv fills them with NaN there."""
        self._on_invalid_pages = callback

    def _invalidated(self, pages: list[int]) -> None:
        if self._on_invalid_pages is not None and pages:
            self._on_invalid_pages(pages)

    def enable_events(self) -> None:
        if self._events is None:
            self._events = []

    @property
    def events_enabled(self) -> bool:
        return self._events is not None

    def drain_events(self) -> list[KVCacheEvent]:
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def _collapse_full_reset(self, mark: int) -> None:
        """A reset that left nothing cached: replace the removals it recorded (from index `mark` on) with one
        AllBlocksCleared, as vLLM reports a reset. A reset that left pages cached (running requests hold them)
        keeps its BlockRemoved events, so subscribers keep those pages."""
        if self._events is not None:
            del self._events[mark:]
            self._events.append(AllBlocksCleared())
