"""The entries of /v1/caches (caches.py): named prefixes the server keeps retained until their expiry, so a request
that names one (`cached_content`) is served on top of KV that is already there, as Gemini's cachedContents.

An entry remembers what makes its prefix (token ids, and for a chat entry its messages, which a request's own are
appended to), whose it is (the owner, as tenant isolation names it, and the cache salt its pages were keyed
with) and when it expires (wall-clock seconds: clients send and read RFC 3339 times). The KV itself is the
engine's, retained by the prewarm that created the entry; the store only decides who may see and use what.

Bounded per owner and in all (a create past either bound is refused, nothing is dropped silently: an entry is a
promise). Expired entries go lazily, when a lookup or a listing meets them; their pages' retention has ended in the
engine at the same deadline, by itself.

The store is the one owner of the entries. With a disk KV tier the server also keeps them in a file beside the
tier's KV (cache_store_file.py), so their names outlive a restart: `on_change` tells it when to write a `snapshot`,
and `restore` registers what it read back at start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prefixkv.engine.prompts import shared_prefix
from prefixkv.server.auth import TAG_LEN

DEFAULT_MAX_ENTRIES_PER_OWNER = 1024
DEFAULT_MAX_ENTRIES = 16384  # all owners together (without keys, every bearer string is an owner)
ID_PREFIX = "cache_"
NAME_PREFIX = "caches/"
GEMINI_NAME_PREFIX = "cachedContents/"  # the same entries as Gemini names them (gemini.py)
# On a listing (caches.py, gemini.py): each row's page token, the one that resumes right after it. A proxy merging
# several servers' listings (the Ray ingress) resumes each exactly where its merged page stopped taking from it.
PAGE_TOKENS_HEADER = "x-prefixkv-page-tokens"
HASHED_BEARER = "bearer-sha256:"  # how the store keeps an owner that is a bearer string (owner_key)


class CacheStoreFull(ValueError):
    """A create past the store's bound for the owner or in all; the message says which."""


@dataclass
class CacheEntry:
    id: str
    owner: str | None  # tenant_owner(): whose entry it is (None: isolation off); the store keeps its owner_key
    cache_salt: str | None  # the salt its pages are keyed with; a request must use the same one to hit them
    kind: str  # "messages" (chat routes) or "prompt" (/v1/completions)
    token_ids: tuple[int, ...]  # the prefix (a messages entry: rendered without a generation prompt)
    messages: tuple[dict[str, str], ...]  # a messages entry's, as the chat template takes them; () for a prompt
    model: str
    display_name: str | None
    create_time: float  # wall-clock seconds
    update_time: float
    expire_time: float
    seq: int = 0  # creation order: newest first in listings, and the page token

    @property
    def name(self) -> str:
        return NAME_PREFIX + self.id

    def seconds_left(self, now: float | None = None) -> float:
        return self.expire_time - (time.time() if now is None else now)

    def body(self, cached_tokens: int, with_tenant: bool = False) -> dict:
        """The resource as the API answers it; with_tenant: an admin's view, which names the owner."""
        out = {
            "id": self.id,
            "object": "cache",
            "name": self.name,
            "display_name": self.display_name,
            "model": self.model,
            "kind": self.kind,
            "create_time": rfc3339(self.create_time),
            "update_time": rfc3339(self.update_time),
            "expire_time": rfc3339(self.expire_time),
            "usage": {"total_tokens": len(self.token_ids), "cached_tokens": cached_tokens},
        }
        if with_tenant:
            out["tenant"] = owner_label(self.owner)
        return out


def rfc3339(seconds: float) -> str:
    """UTC with microseconds and a Z, as Gemini writes times."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def owner_label(owner: str | None) -> str | None:
    """The tenant an admin reads: a key file's tenant or a `user` value as given (what `?tenant=` takes
    elsewhere); a bearer string (no keys configured) only as its tag (its salts' prefix), never in the clear."""
    owner = owner_key(owner)
    if owner is None:
        return None
    kind, _, name = owner.partition(":")
    return name if kind in ("tenant", "user") else "bearer:" + name[:TAG_LEN]


def owner_key(owner: str | None) -> str | None:
    """The form the store keeps and compares an owner in. A bearer string (tenant isolation by api-key without a
    key file: the token itself names the tenant) only as its sha256, so no token is kept past its request or written
    to disk (cache_store_file.py); a tenant, a user or None as it is."""
    if owner is None or not owner.startswith("bearer:"):
        return owner
    return HASHED_BEARER + hashlib.sha256(owner.encode()).hexdigest()


def entry_id_of(name: str) -> str:
    """An entry's id from its id or its name ("cache_x", "caches/cache_x" or Gemini's "cachedContents/cache_x")."""
    for prefix in (NAME_PREFIX, GEMINI_NAME_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


@dataclass
class CacheStore:
    max_per_owner: int = DEFAULT_MAX_ENTRIES_PER_OWNER
    max_entries: int = DEFAULT_MAX_ENTRIES
    clock: Callable[[], float] = time.time
    # called (under the store's lock: it must be quick and not call back) after every change: an add, a remove, a
    # new expiry, expired entries dropped
    on_change: Callable[[], None] | None = None
    _entries: dict[str, CacheEntry] = field(default_factory=dict)
    _seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.max_per_owner < 1 or self.max_entries < 1:
            raise ValueError(f"the store's bounds must be >= 1, got {self.max_per_owner}, {self.max_entries}")

    def __len__(self) -> int:
        return len(self._entries)

    def check_room(self, owner: str | None) -> None:
        """CacheStoreFull unless one more entry of `owner` fits (expired ones are dropped first)."""
        with self._lock:
            self._check_room(owner)

    def add(self, entry: CacheEntry) -> CacheEntry:
        with self._lock:
            entry.owner = owner_key(entry.owner)
            self._check_room(entry.owner)
            entry.seq = next(self._seq)
            self._entries[entry.id] = entry
            self._changed()
            return entry

    def restore(self, entries: Iterable[CacheEntry]) -> list[CacheEntry]:
        """Register entries read back at start (cache_store_file.py) with their ids and creation order; expired ones
        are left out, and so are those past a bound (oldest first, as creates would have been refused): the ones
        not taken are returned. Not a change: on_change is not called."""
        left_out: list[CacheEntry] = []
        with self._lock:
            now = self.clock()
            for entry in sorted(entries, key=lambda e: e.seq):
                entry.owner = owner_key(entry.owner)
                if entry.expire_time <= now or entry.id in self._entries or not self._has_room(entry.owner):
                    left_out.append(entry)
                    continue
                self._entries[entry.id] = entry
            last = max((e.seq for e in self._entries.values()), default=0)
            self._seq = itertools.count(max(last + 1, next(self._seq)))
        return left_out

    def snapshot(self) -> list[CacheEntry]:
        """Copies of the live entries, oldest first (what cache_store_file.py writes)."""
        with self._lock:
            now = self.clock()
            rows = [dataclasses.replace(e) for e in self._entries.values() if e.expire_time > now]
        return sorted(rows, key=lambda e: e.seq)

    def get(self, entry_id: str, owner: str | None, admin: bool = False) -> CacheEntry | None:
        """The live entry of that id if `owner` may see it (an admin sees all); another owner's is not found."""
        owner = owner_key(owner)
        with self._lock:
            entry = self._live(entry_id)
            return entry if entry is not None and (admin or entry.owner == owner) else None

    def remove(self, entry_id: str) -> CacheEntry | None:
        with self._lock:
            entry = self._entries.pop(entry_id, None)
            if entry is not None:
                self._changed()
            return entry

    def set_expiry(self, entry_id: str, expire_time: float) -> CacheEntry | None:
        """None when the entry is gone meanwhile (deleted, expired)."""
        with self._lock:
            entry = self._live(entry_id)
            if entry is not None:
                entry.expire_time, entry.update_time = expire_time, self.clock()
                self._changed()
            return entry

    def listing(self, owner: str | None, admin: bool = False, before_seq: int | None = None) -> list[CacheEntry]:
        """Live entries `owner` may see, newest first; before_seq: only those created before that one."""
        owner = owner_key(owner)
        with self._lock:
            self._purge()
            rows = [
                e
                for e in self._entries.values()
                if (admin or e.owner == owner) and (before_seq is None or e.seq < before_seq)
            ]
        return sorted(rows, key=lambda e: e.seq, reverse=True)

    def kept_prefix(self, entry: CacheEntry) -> int:
        """Tokens of `entry`'s prefix another live entry of its owner and salt still retains: what releasing
        `entry` must leave retained."""
        with self._lock:
            self._purge()
            others = [
                e
                for e in self._entries.values()
                if e.id != entry.id and e.owner == entry.owner and e.cache_salt == entry.cache_salt
            ]
        return max((shared_prefix(entry.token_ids, e.token_ids) for e in others), default=0)

    def _live(self, entry_id: str) -> CacheEntry | None:
        entry = self._entries.get(entry_id)
        if entry is not None and entry.expire_time <= self.clock():
            del self._entries[entry_id]
            self._changed()
            return None
        return entry

    def _purge(self) -> None:
        now = self.clock()
        expired = [i for i, e in self._entries.items() if e.expire_time <= now]
        for entry_id in expired:
            del self._entries[entry_id]
        if expired:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _owned_by(self, owner: str | None) -> int:
        return sum(1 for e in self._entries.values() if e.owner == owner)

    def _has_room(self, owner: str | None) -> bool:
        return len(self._entries) < self.max_entries and self._owned_by(owner) < self.max_per_owner

    def _check_room(self, owner: str | None) -> None:
        owner = owner_key(owner)
        self._purge()
        if len(self._entries) >= self.max_entries:
            raise CacheStoreFull(f"the server holds its maximum of {self.max_entries} cache entries; delete some")
        if self._owned_by(owner) >= self.max_per_owner:
            raise CacheStoreFull(
                f"at most {self.max_per_owner} cache entries per tenant; delete some (DELETE /v1/caches/{{id}})"
            )
