"""The /v1/caches entries (cache_store.py) in a file beside the disk KV tier's KV, so that a server restarted on the
same directory answers the same names.

Why there: an entry is a name for a prefix whose KV the server keeps. Without a disk tier that KV ends with the
process, and so do the entries (nothing is written). With one, an entry's KV is often still on disk after a
restart; keeping the names in the same directory lets a client's `cached_content: caches/cache_x` find it again
(loaded from the tier, or recomputed, on first use) instead of getting a 400. A directory the tier ignores as
another model's (kv_offload_on_mismatch=ignore) is not touched here either: the engine then names none.

What is kept: every live entry as the store holds it (ids, owners, a bearer-string owner only as its hash, cache
salts, kind, token ids, messages, display name, times, creation order), and the identity it was written for: the
tier's manifest (weights digest, dtype, kernels, ...) and a fingerprint of the tokenizer and chat template, since
token ids mean something only to the tokenizer that made them. At start, expired entries are left out and the
rest registered as they were. Their pages are not warmed then (that could take minutes, before /health): the first
request on an entry loads what the tier holds or recomputes it, and retains the prefix until the entry's expiry,
as every use does (cached_content.use_retention); a PATCH warms and retains it at once, as before.

A file written for another model, tokenizer or file format, or one that cannot be read, follows
kv_offload_on_mismatch like the tier's directory: refuse raises CacheEntriesFileError (the server does not start;
the message names the file and what differs), ignore logs a warning and starts empty (the file is replaced at the
next change). The file is parsed and checked whole before any entry is registered: never half a store.

Writes: the whole store as JSON into a temp file, fsync'ed (a file torn by a power loss would stop a refusing
server from starting), then os.replace'd onto the name. A background thread does them, so a create never waits on
the disk; it coalesces changes that come while it writes, and close() (the app's shutdown) writes what is left,
so a clean stop loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

from prefixkv.engine.client import EngineClient, EngineTokenizer
from prefixkv.server.cache_store import ID_PREFIX, CacheEntry, CacheStore

logger = logging.getLogger(__name__)

FILE_NAME = "cache_entries.json"
FORMAT = "prefixkv-cache-entries"
FORMAT_VERSION = 1  # bump when the rows below change: an older server then treats the file as another's
# Text whose ids, alone and through the chat template, fingerprint the tokenizer: scripts, digits, spacing, emoji.
_PROBE = "Hello, wörld!  1234 + 5.6e-7 = x;\n\tdef f(): return 'ünïcödé' 日本語 «ß» Ωμέγα 🙂"


class CacheEntriesFileError(ValueError):
    """The entries file cannot be read, or was written for another model, tokenizer or format."""


def open_cache_store(engine: EngineClient, served_model_name: str) -> tuple[CacheStore, CacheStoreFile | None]:
    """The server's entry store: in memory only without a disk tier (file None); with one, read back from the
    tier directory's file and written there on every change (close the file at shutdown). Raises
    CacheEntriesFileError for a bad file under kv_offload_on_mismatch=refuse."""
    store = CacheStore()
    directory = engine.tier_directory
    if directory is None:
        return store, None
    path = Path(directory.path) / FILE_NAME
    identity = {"kv_tier": directory.manifest, "tokenizer": tokenizer_fingerprint(engine.tokenizer)}
    try:
        entries = read_entries(path, identity)
    except CacheEntriesFileError as exc:
        if engine.config.kv_offload_on_mismatch != "ignore":
            raise
        logger.warning(
            "%s; starting without its entries (kv_offload_on_mismatch=ignore): the file is replaced at the next change",
            exc,
        )
        entries = []
    # what a create checks of the engine: an entry whose pages the pool could never retain whole is left out
    retained, page = engine.cache_summary().retained_capacity, engine.config.tokens_per_page
    fits = [e for e in entries if len(e.token_ids) // page <= retained]
    for entry in fits:
        entry.model = served_model_name  # the same weights and tokenizer (checked), perhaps served under a new name
    left_out = store.restore(fits)
    expired = sum(1 for e in left_out if e.expire_time <= store.clock())
    if entries:
        logger.info("cache entries: %d restored from %s, %d expired", len(store), path, expired)
    if len(store) + expired < len(entries):  # an entry is a promise: never dropped without a word
        logger.warning(
            "cache entries: %d in %s left out: past the store's bounds, or larger than the retained pool "
            "(--retained-pool-fraction) could ever hold",
            len(entries) - len(store) - expired,
            path,
        )
    file = CacheStoreFile(path, identity, store)
    store.on_change = file.changed
    if len(store) < len(entries):
        file.changed()  # the file without what was left out
    return store, file


def tokenizer_fingerprint(tokenizer: EngineTokenizer) -> str:
    """sha256 of a probe text's ids, alone and as a one-message conversation through the chat template."""
    ids = tokenizer.encode(_PROBE)
    chat = tokenizer.encode_chat([{"role": "user", "content": _PROBE}], add_generation_prompt=False)
    return hashlib.sha256(json.dumps([ids, chat]).encode()).hexdigest()


def read_entries(path: Path, identity: dict[str, Any]) -> list[CacheEntry]:
    """The entries in the file at `path` (none when there is no file), all checked; CacheEntriesFileError when it
    cannot be read or was written for another identity."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise CacheEntriesFileError(f"cache entry file {path} is unreadable ({exc})") from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise CacheEntriesFileError(f"cache entry file {path} is unreadable ({exc})") from None
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        found = f"{data.get('format')!r} version {data.get('format_version')!r}"
        raise CacheEntriesFileError(
            f"cache entry file {path} is not a {FORMAT} file of version {FORMAT_VERSION} (it says {found})"
        )
    differences = _differences(identity, data.get("identity"))
    if differences:
        raise CacheEntriesFileError(
            f"cache entry file {path} was written for another model or tokenizer ({'; '.join(differences)}; "
            "values: this server's != the file's)"
        )
    rows = data.get("entries")
    if not isinstance(rows, list):
        raise CacheEntriesFileError(f"cache entry file {path} is unreadable ('entries' is not a list)")
    entries = []
    for i, row in enumerate(rows):
        try:
            entries.append(_entry(row))
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheEntriesFileError(f"cache entry file {path} is unreadable (entry {i}: {exc})") from None
    return entries


class CacheStoreFile:
    """Writes `store` into `path` after every change, from a background thread (started at the first change)."""

    def __init__(self, path: Path, identity: dict[str, Any], store: CacheStore) -> None:
        self.path, self.identity, self.store = path, identity, store
        self._cond = threading.Condition()
        self._dirty = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def changed(self) -> None:
        """The store changed (its on_change: called under the store's lock, so nothing here waits on it)."""
        with self._cond:
            if self._closed:
                logger.warning("cache entries changed after shutdown began: %s does not have the change", self.path)
                return
            self._dirty = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prefixkv-cache-entries", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Write what is not written yet, and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def write(self) -> None:
        """The store as it is now, into the file (atomically). A failed write is logged; the next change retries."""
        rows = [_row(e) for e in self.store.snapshot()]
        content = {"format": FORMAT, "format_version": FORMAT_VERSION, "identity": self.identity, "entries": rows}
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")  # the disk tier removes strays at open
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # tenants' prompts: the owner only
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(content, f, separators=(",", ":"))  # ASCII: a lone surrogate in a message is no error
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path)
        except (OSError, ValueError) as exc:
            logger.warning("cache entries not saved to %s: %s", self.path, exc)
            temp.unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._dirty and not self._closed:
                    self._cond.wait()
                if not self._dirty:
                    return
                self._dirty = False
            self.write()


def _differences(ours: dict[str, Any], theirs: object) -> list[str]:
    """'field: ours != theirs' for each identity field that differs (a nested dict's fields as 'name.field')."""
    if not isinstance(theirs, dict):
        return [f"identity: {theirs!r} is not an object"]
    out = []
    for key in sorted(set(ours) | set(theirs)):
        mine, other = ours.get(key, "(absent)"), theirs.get(key, "(absent)")
        if isinstance(mine, dict) and isinstance(other, dict):
            out += [f"{key}.{d}" for d in _differences(mine, other)]
        elif mine != other:
            out.append(f"{key}: {mine!r} != {other!r}")
    return out


def _row(entry: CacheEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "owner": entry.owner,
        "cache_salt": entry.cache_salt,
        "kind": entry.kind,
        "token_ids": entry.token_ids,
        "messages": entry.messages,
        "model": entry.model,
        "display_name": entry.display_name,
        "create_time": entry.create_time,
        "update_time": entry.update_time,
        "expire_time": entry.expire_time,
        "seq": entry.seq,
    }


def _entry(row: object) -> CacheEntry:
    """A row back as an entry; ValueError (or KeyError, TypeError) naming what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError("not an object")
    entry_id = _field(row, "id", str)
    if not entry_id.startswith(ID_PREFIX):
        raise ValueError(f"id {entry_id!r} is not a cache entry id")
    kind = _field(row, "kind", str)
    if kind not in ("messages", "prompt"):
        raise ValueError(f"kind {kind!r}")
    token_ids = _field(row, "token_ids", list)
    if not token_ids or not all(type(t) is int and t >= 0 for t in token_ids):
        raise ValueError("token_ids must be a non-empty list of token ids")
    messages = _field(row, "messages", list)
    if not all(isinstance(m, dict) and all(isinstance(v, str) for v in m.values()) for m in messages):
        raise ValueError("messages must be objects of strings")
    seq = _field(row, "seq", int)
    if seq < 1:
        raise ValueError(f"seq {seq}")
    return CacheEntry(
        id=entry_id,
        owner=_field(row, "owner", str, optional=True),
        cache_salt=_field(row, "cache_salt", str, optional=True),
        kind=kind,
        token_ids=tuple(token_ids),
        messages=tuple(messages),
        model=_field(row, "model", str),
        display_name=_field(row, "display_name", str, optional=True),
        create_time=_time(row, "create_time"),
        update_time=_time(row, "update_time"),
        expire_time=_time(row, "expire_time"),
        seq=seq,
    )


def _field(row: dict, name: str, kind: type, optional: bool = False) -> Any:
    value = row[name]
    if (value is None and optional) or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise TypeError(f"{name} is {type(value).__name__}, not {kind.__name__}")


def _time(row: dict, name: str) -> float:
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    return float(value)
