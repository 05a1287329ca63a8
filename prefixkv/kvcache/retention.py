"""Per-request retention: cached pages a request asked to keep, spared by eviction until a deadline.

SGLang tried hard pins first and moved to priorities with a time limit: a pin that never ends lets a few clients
fill the pool and starve admission. Here a request may carry `retention_seconds` (and a `retention_priority`);
the pages it computes or hits are retained until now + retention_seconds. Eviction takes unretained pages first
and retained ones only when nothing else is left (the weakest first: lowest priority, then earliest deadline,
then the deepest page, so a retained prefix shrinks from its end). After the deadline a page is ordinary again.

The cap: retained pages never exceed `retained_pool_fraction` of the pool. Retaining past it releases the
weakest retentions first (which may be the new request's own deepest pages when everything held is stronger),
so the pool always keeps most of its pages for plain LRU/LFU/cost eviction, and since retained pages stay
evictable as a last resort an allocation never fails because of retention.

One table per KV manager, keyed by page id (a page keeps its id while cached: radix splits and trims move none).
The table only records; the caches ask it what is retained when they evict.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixkv.request_options import NO_RETENTION, Retention

if TYPE_CHECKING:
    from prefixkv.request import Request

# OpenAI's prompt_cache_retention values -> a request's Retention (request_options.py). "in_memory" is the default
# behaviour (pages stay while the pool's eviction order keeps them); "24h" retains the request's pages for a day at
# priority 1, within retained_pool_fraction. With a KV offload (disk) tier, written-through pages also persist
# there, so such a prefix outlives its eviction from the pool and a restart.
PROMPT_CACHE_RETENTION: dict[str, Retention] = {
    "in_memory": NO_RETENTION,
    "24h": Retention(86400.0, 1),
}


@dataclass(slots=True)
class _Entry:
    priority: int
    deadline: float
    depth: int  # the page's index in its sequence: among equals the deepest is released/evicted first
    version: int  # its current heap entries carry this; older ones are stale


class RetentionTable:
    def __init__(
        self, num_pages: int, retained_pool_fraction: float = 0.2, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(retained_pool_fraction, (int, float)) or not 0 <= retained_pool_fraction <= 1:
            raise ValueError(f"retained_pool_fraction must be in [0, 1], got {retained_pool_fraction!r}")
        self.capacity = int(num_pages * retained_pool_fraction)  # most pages retained at once
        self.clock = clock  # wall time in an engine; the simulation's clock in a simulator (injected at construction)
        self._entries: dict[int, _Entry] = {}
        self._by_deadline: list[tuple[float, int, int]] = []  # (deadline, version, page)
        self._by_strength: list[tuple[int, float, int, int, int]] = []  # (priority, deadline, -depth, version, page)
        self._versions = itertools.count(1)
        self.released_by_cap = 0  # pages whose retention the cap ended early
        # told of every page whose retention ends by expiry, the cap or release() (not by discard(): the cache
        # asked for that)
        self.on_end: Callable[[int], None] | None = None
        self.expired = 0  # pages whose retention ran out
        self._lapsed: set[int] = set()  # cached pages whose retention ran out (not ended by the cap), until evicted
        # the pages a retention without end would hold now: the `capacity` most recently retained (what the cap
        # keeps when no deadline passes first). A lapsed page outside it was the cap's to drop anyway.
        self._endless: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page: int) -> bool:
        return page in self._entries

    def pages(self) -> list[int]:
        return list(self._entries)

    def rank(self, page: int) -> tuple[int, float, int]:
        """Lower is weaker: released by the cap, or evicted when only retained pages are left, first."""
        e = self._entries[page]
        return e.priority, e.deadline, -e.depth

    def retain(self, pages: Sequence[int], first_depth: int, priority: int, seconds: float) -> list[int]:
        """Retain `pages` (indices first_depth, first_depth + 1, ... of their sequence) for `seconds` from now; a
        page already retained keeps the stronger of both. Returns the pages that stopped being retained
        (expired, or released by the cap; on_end hears of each)."""
        if not self.capacity or seconds <= 0 or not pages:
            return []
        now = self.clock()
        ended = self.expire(now)
        deadline = now + seconds
        endless = self._endless
        for page in pages:
            endless[page] = None
            endless.move_to_end(page)
        while len(endless) > self.capacity:
            endless.popitem(last=False)
        for k, page in enumerate(pages):
            old = self._entries.get(page)
            if old is not None and old.priority >= priority and old.deadline >= deadline:
                continue
            if old is not None:
                priority_k, deadline_k = max(old.priority, priority), max(old.deadline, deadline)
            else:
                priority_k, deadline_k = priority, deadline
            entry = _Entry(priority_k, deadline_k, first_depth + k, next(self._versions))
            self._entries[page] = entry
            self._lapsed.discard(page)
            heapq.heappush(self._by_deadline, (entry.deadline, entry.version, page))
            heapq.heappush(self._by_strength, (entry.priority, entry.deadline, -entry.depth, entry.version, page))
        while len(self._entries) > self.capacity:
            _, _, _, version, page = heapq.heappop(self._by_strength)
            if self._current(page, version):
                del self._entries[page]
                self.released_by_cap += 1
                ended.append(page)
                if self.on_end is not None:
                    self.on_end(page)
        self._compact()
        return ended

    def expire(self, now: float | None = None) -> list[int]:
        """Forget retentions whose deadline has passed; returns their pages."""
        if not self._entries:
            return []
        now = self.clock() if now is None else now
        heap, ended = self._by_deadline, []
        while heap and heap[0][0] <= now:
            _, version, page = heapq.heappop(heap)
            if self._current(page, version):
                del self._entries[page]
                self.expired += 1
                self._lapsed.add(page)
                ended.append(page)
                if self.on_end is not None:
                    self.on_end(page)
        return ended

    def release(self, pages: Sequence[int]) -> list[int]:
        """End the retention of `pages` now (a retained prefix its owner let go: a deleted or shortened cache
        entry). They stay cached, as ordinary pages of the eviction order; on_end hears of each, so a cache that
        set one aside puts it back. Returns the pages that were retained."""
        ended = []
        for page in pages:
            self._endless.pop(page, None)
            if self._entries.pop(page, None) is not None:
                ended.append(page)
                if self.on_end is not None:
                    self.on_end(page)
        return ended

    def discard(self, page: int) -> None:
        """The page left the cache (evicted, reset): its retention goes with it."""
        self._entries.pop(page, None)
        self._lapsed.discard(page)

    def lapsed(self, page: int) -> bool:
        """Whether an eviction of the page now is the TTL's doing (miss_reasons.py calls it expired): it was
        retained, its deadline has passed (the cap ending it early does not count), and without deadlines the cap
        would still hold it (fewer than `capacity` pages were retained since; same-priority retentions assumed).
        Otherwise the cap, not the TTL, would have let it go, and its eviction is capacity's."""
        if page not in self._endless:
            return False
        if page in self._lapsed:
            return True
        entry = self._entries.get(page)
        return entry is not None and entry.deadline <= self.clock()

    def _current(self, page: int, version: int) -> bool:
        entry = self._entries.get(page)
        return entry is not None and entry.version == version

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones (re-retained pages leave one each)."""
        if len(self._by_deadline) + len(self._by_strength) > 8 * len(self._entries) + 128:
            self._by_deadline = [(e.deadline, e.version, p) for p, e in self._entries.items()]
            self._by_strength = [(e.priority, e.deadline, -e.depth, e.version, p) for p, e in self._entries.items()]
            heapq.heapify(self._by_deadline)
            heapq.heapify(self._by_strength)

    def check(self) -> None:
        assert len(self._entries) <= self.capacity, f"{len(self._entries)} retained pages > cap {self.capacity}"
        for page, e in self._entries.items():
            assert math.isfinite(e.deadline), f"page {page}: deadline {e.deadline}"

    def summary(self) -> dict:
        """The retention now: retentions past their deadline are ended first."""
        self.expire()
        return {
            "retained_pages": len(self._entries),
            "retained_capacity": self.capacity,
            "retention_released_by_cap": self.released_by_cap,
            "retention_expired": self.expired,
        }


def retain_request_pages(
    table: RetentionTable, request: Request, pages: Sequence[int], first_depth: int, page_size: int
) -> None:
    """The retention `request` asked for, on its pages `pages` (indices first_depth, first_depth + 1, ...):
    retention_seconds covers them all; each (prefix tokens, seconds) of retention_spans the pages wholly inside
    that prefix. A page under several keeps the longest (RetentionTable.retain keeps the stronger)."""
    priority = request.retention_priority
    if request.retention_seconds:
        table.retain(pages, first_depth, priority, request.retention_seconds)
    for prefix_tokens, seconds in request.retention_spans:
        inside = prefix_tokens // page_size - first_depth
        if inside > 0:
            table.retain(pages[:inside], first_depth, priority, seconds)
