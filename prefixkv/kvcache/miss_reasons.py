"""Why a prompt missed the cache: a listener inside each prefix cache that remembers just enough to say.

Users of every engine ask why a request missed (vLLM issues #45633, #36084: weeks of "0% hit" and no way to see
why). The answer needs history the cache itself throws away, so each cache tells this listener what it does, as
it would tell a KV event subscriber: a page became findable (stored), a page was dropped (evicted, with the
policy and whether its retention had run out), a request ended (forget).

It keys pages itself, the same way for both caches and cheaply: a content key chains a page's tokens (and
multimodal hashes) onto the page before it with Python's hash (a collision only mislabels a diagnosis), and a
page's key is its content key in its namespace (adapter, tenant salt). It keeps:
- which page holds which key now;
- a bounded ring of evicted keys with when, why and by which policy (the oldest fall out; the simulator keeps
  every one), and a Bloom filter of the keys that fell out of it, so that an eviction older than the ring reads
  as unknown and never as never_seen (a page never cached may read unknown too, a false positive of the filter);
- how many cached pages hold each content key, so a page missing under this request's salt or adapter but held
  under another's is told apart (isolated);
- the keys running requests will compute: a page another request is computing right now is in_flight;
- optionally (`elsewhere`), whether another replica holds a key: such a page is the router's miss (routed).
  Behind a real router no replica sees another's cache; the router's index does, and says on the request how
  many leading prompt tokens another replica holds (Request.held_elsewhere_tokens): a missed page ending within
  them is routed too.

At a request's first admission the scheduler asks `explain` (through KVCacheManager.explain_miss, before the
allocation keys anything) and gets a CacheMiss: each page past the hit gets one cause, tested in the order
in_flight, routed, evicted/expired, isolated, unknown, never_seen; a page that is findable but past an earlier missed
page takes that page's cause (the chain broke there); the tail no hit can cover (a partial page, the last
token) is granularity. The causes add up to the missed tokens exactly, by construction. Pages under 16 tokens
are tracked in units of 16 tokens (see MissExplainer.unit): there the partial unit at the end counts as
granularity too.

The admission registers the pages it will compute (`admitted`) after `explain`, so a request never finds itself
in flight. A page the pool dropped while a KV offload tier kept it is served by the tier, so it is no miss.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from prefixkv.cache_miss import CacheMiss
from prefixkv.request import Request


class _Eviction(NamedTuple):
    at: float
    cause: str  # "evicted" or "expired"
    policy: str


Key = tuple[object, int]  # (namespace, content key)
MIN_UNIT_TOKENS = 16


class FellOut:
    """The keys whose eviction fell out of the bounded history: a Bloom filter, so one of them never reads as
    never seen, in a fixed size. A key that never fell out may test positive (then its miss reads unknown): with
    `bits_per_entry` bits and 4 hashes per history entry, that chance is 1e-5 once a ring's worth fell out, 0.2%
    at four rings' worth, 16% at sixteen (a long-running engine's unknown grows: it is what it cannot tell)."""

    HASHES = 4

    def __init__(self, entries: int, bits_per_entry: int = 64) -> None:
        self.size = max(entries * bits_per_entry, 1 << 16)
        self._bits = bytearray(-(-self.size // 8))
        self.added = 0

    def _indexes(self, key: Key) -> list[int]:
        h = hash(key) & 0xFFFF_FFFF_FFFF_FFFF
        low, step = h & 0xFFFF_FFFF, (h >> 32) | 1  # double hashing (Kirsch-Mitzenmacher)
        return [(low + i * step) % self.size for i in range(self.HASHES)]

    def add(self, key: Key) -> None:
        for i in self._indexes(key):
            self._bits[i >> 3] |= 1 << (i & 7)
        self.added += 1

    def __contains__(self, key: Key) -> bool:
        return self.added > 0 and all(self._bits[i >> 3] >> (i & 7) & 1 for i in self._indexes(key))


class MissExplainer:
    def __init__(
        self, page_size: int, clock: Callable[[], float] = time.monotonic, history_capacity: int | None = 65536
    ) -> None:
        """history_capacity: evicted keys remembered (None: all, for the simulator's exact breakdowns); the keys
        that fall out of them go to a filter (FellOut) and their misses read unknown."""
        if history_capacity is not None and history_capacity < 0:
            raise ValueError(f"history_capacity must be >= 0 or None, got {history_capacity!r}")
        self.page_size = page_size
        # the unit it tracks: whole pages of at least MIN_UNIT_TOKENS tokens (with one-token pages, a Python call
        # per token would cost more than the cache itself); a unit is findable when its last page is
        self._pages_per_unit = -(-MIN_UNIT_TOKENS // page_size)
        self.unit = page_size * self._pages_per_unit
        self.clock = clock
        self.history_capacity = history_capacity
        self._key_of_page: dict[int, Key] = {}
        self._page_of_key: dict[Key, int] = {}
        self._content_count: dict[int, int] = {}  # content key -> findable pages with it (any namespace)
        self._history: OrderedDict[Key, _Eviction] = OrderedDict()
        self._fell_out = FellOut(history_capacity or 0)  # stays empty when the history keeps every eviction
        self._pending: dict[Key, int] = {}  # key -> running requests that will compute it
        self._pending_of: dict[str, set[Key]] = {}  # request id -> its pending keys
        self._chains: dict[str, list[int]] = {}  # request id -> its content keys so far
        # whether another replica holds a key now (set by whoever sees the fleet, e.g. the replica simulator)
        self.elsewhere: Callable[[Key], bool] | None = None

    def holds(self, key: Key) -> bool:
        """Whether a page with this key is findable now."""
        return key in self._page_of_key

    # -- what the cache tells --------------------------------------------------------------------------------
    def stored(self, page: int, request: Request, index: int) -> None:
        """Page `page` became findable: page `index` of `request`."""
        if (index + 1) % self._pages_per_unit:
            return  # not the last page of a unit
        unit = (index + 1) // self._pages_per_unit - 1
        key = (request.extra_keys, self._content_keys(request, unit + 1)[unit])
        self._key_of_page[page] = key
        self._page_of_key[key] = page
        self._history.pop(key, None)
        self._content_count[key[1]] = self._content_count.get(key[1], 0) + 1
        mine = self._pending_of.get(request.request_id)
        if mine is not None and key in mine:
            mine.discard(key)
            self._unpend(key)

    def evicted(self, page: int, policy: str, expired: bool) -> None:
        """Page `page` was dropped (policy: the eviction policy or "reset"); expired: its retention had run out."""
        key = self._unstore(page)
        if key is None:
            return
        history = self._history
        history[key] = _Eviction(self.clock(), "expired" if expired else "evicted", policy)
        history.move_to_end(key)
        if self.history_capacity is not None and len(history) > self.history_capacity:
            self._fell_out.add(history.popitem(last=False)[0])

    def unstored(self, page: int) -> None:
        """Page `page` stopped being findable without being evicted (keyed in flight, never computed)."""
        self._unstore(page)

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted, preempted): its pending keys and memo go."""
        self._chains.pop(request_id, None)
        for key in self._pending_of.pop(request_id, ()):
            self._unpend(key)

    def _unstore(self, page: int) -> Key | None:
        key = self._key_of_page.pop(page, None)
        if key is None:
            return None
        if self._page_of_key.get(key) == page:
            del self._page_of_key[key]
        left = self._content_count[key[1]] - 1
        if left:
            self._content_count[key[1]] = left
        else:
            del self._content_count[key[1]]
        return key

    def _unpend(self, key: Key) -> None:
        left = self._pending[key] - 1
        if left:
            self._pending[key] = left
        else:
            del self._pending[key]

    def _content_keys(self, request: Request, num_units: int) -> list[int]:
        """The request's content keys for its first num_units units (at least; memoised until forget())."""
        chain = self._chains.setdefault(request.request_id, [])
        tokens, ps, mm = request.token_ids, self.unit, request.mm_hashes
        for j in range(len(chain), num_units):
            page = tuple(tokens[j * ps : (j + 1) * ps])
            images = tuple(m.hash for m in mm if m.offset < (j + 1) * ps and m.offset + m.length > j * ps) if mm else ()
            chain.append(hash((chain[-1] if chain else 0, page, images)))
        return chain

    # -- the answer ------------------------------------------------------------------------------------------
    def _coverable_units(self, request: Request) -> int:
        """Units a hit could cover whole (a hit is whole pages, never the last token)."""
        return max(request.num_tokens - 1, 0) // self.page_size * self.page_size // self.unit

    def admitted(self, request: Request, hit_tokens: int) -> None:
        """The request took its hit and will compute the rest: its units a hit could cover, not findable now, are
        in flight until it stores them or leaves (the cache calls this at first admission, before keying any)."""
        coverable = self._coverable_units(request)
        contents, ns = self._content_keys(request, coverable), request.extra_keys
        pending = self._pending_of.setdefault(request.request_id, set())
        for j in range(hit_tokens // self.unit, coverable):
            key = (ns, contents[j])
            if key not in self._page_of_key and key not in pending:
                pending.add(key)
                self._pending[key] = self._pending.get(key, 0) + 1

    def explain(self, request: Request, hit_tokens: int) -> CacheMiss:
        """Why request's prompt past `hit_tokens` was not served. No side effects: ask before the admission keys
        anything."""
        unit = self.unit
        coverable = self._coverable_units(request)
        contents, ns = self._content_keys(request, coverable), request.extra_keys
        by_cause: dict[str, int] = {}
        first_cause: str | None = None
        policy: str | None = None
        ago: float | None = None
        previous: str | None = None
        held_elsewhere = request.held_elsewhere_tokens
        for j in range(hit_tokens // unit, coverable):
            key = (ns, contents[j])
            if key in self._page_of_key:
                cause = previous or "in_flight"  # findable past a missed page: the chain broke before it
            else:
                eviction = self._history.get(key)
                if self._pending.get(key):
                    cause = "in_flight"
                elif (j + 1) * unit <= held_elsewhere or (self.elsewhere is not None and self.elsewhere(key)):
                    cause = "routed"
                elif eviction is not None:
                    cause = eviction.cause
                    if first_cause is None:
                        policy, ago = eviction.policy, self.clock() - eviction.at
                elif contents[j] in self._content_count:
                    cause = "isolated"
                elif key in self._fell_out:
                    cause = "unknown"  # its eviction fell out of the history: evicted or expired, no longer known
                else:
                    cause = "never_seen"
            by_cause[cause] = by_cause.get(cause, 0) + (j + 1) * unit - max(j * unit, hit_tokens)
            first_cause = first_cause or cause
            previous = cause
        tail = request.num_tokens - max(coverable * unit, hit_tokens)
        if tail > 0:
            by_cause["granularity"] = by_cause.get("granularity", 0) + tail
        return CacheMiss(
            first_missed_token=hit_tokens,
            cause=first_cause or "granularity",
            tokens_by_cause=by_cause,
            policy=policy,
            evicted_s_ago=ago,
        )

    def check(self, findable: set[int]) -> None:
        """The listener's view equals the cache's (tests): `findable`, the pages a lookup can find now."""
        assert self._key_of_page.keys() <= findable, "the miss listener holds pages the cache dropped"
        if self._pages_per_unit == 1:
            assert len(self._key_of_page) == len(findable), "the miss listener missed a findable page"
        assert len(self._page_of_key) == len(self._key_of_page), "two findable pages under one key"
        assert sum(self._content_count.values()) == len(self._key_of_page)
        assert all(n > 0 for n in self._pending.values())
