"""A KV tier in a directory: one checksummed file per chunk payload, a manifest, LRU within a byte budget.

Layout of a tier directory:

    path/manifest.json        the TierManifest of the KV inside, plus a format marker (written atomically)
    path/lock                 flock'ed by the one process using the directory; holds that process's pid
    path/ab/ab12...ef         one entry: a fixed 64-byte header, then the payload; named by the key's hex and
                              fanned out by its first two hex characters (256 folders, none holds 100k files)

Entry header (little-endian): magic b"PKVT", format version (u16), key length (u16), payload length (u64), the key
(zero-padded to 32 bytes), then an xxh3-128 checksum over the 48 header bytes before it and the payload. xxh3 reads
at many GB/s, so checking a 6 MB payload costs well under a millisecond, and 128 bits make an undetected random
change (a torn write, a flipped bit, a truncation, a file from elsewhere) practically impossible. It is not a MAC:
someone who can write to the directory can forge entries, just as they could replace the weights; the directory is
trusted, its medium is not.

Writes are atomic: an entry is written to a hidden temp file in its own folder, then os.replace'd onto its name, so
a process killed mid-write leaves at most a temp file (removed when the tier next opens), never a partial entry.
No fsync: a killed process loses nothing the kernel already has, and after a power loss or OS crash a renamed file
whose data never reached the disk fails its checksum and is dropped like any damaged entry. A miss only costs a
recompute, so the tier does not pay a disk flush (milliseconds) per entry for durability it does not need.
`fsync=True` buys it anyway.

Recency survives restarts: every put and every hit stamps the file's mtime with a strictly increasing clock, and
opening the directory rebuilds the LRU order from the mtimes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, fields
from pathlib import Path
from typing import Literal

import xxhash

from prefixkv.kvcache.offload.tier import TierManifest, TierStats

logger = logging.getLogger(__name__)

FORMAT = "prefixkv-disk-tier"  # manifest.json's "format": marks a directory as ours
FORMAT_VERSION = 1  # bump when the directory layout or the entry header changes
MAGIC = b"PKVT"
MAX_KEY_BYTES = 32
HEADER = struct.Struct(f"<4sHHQ{MAX_KEY_BYTES}s")  # magic, version, key length, payload length, key
CHECKSUM_BYTES = 16  # xxh3-128 digest, right after HEADER
HEADER_BYTES = HEADER.size + CHECKSUM_BYTES  # 64
MANIFEST_NAME = "manifest.json"
LOCK_NAME = "lock"
TEMP_SUFFIX = ".tmp"  # temp files are ".<name>.<pid>.<n>.tmp"; the leading dot keeps them out of the entry scan

MismatchPolicy = Literal["refuse", "ignore"]


class TierMismatchError(ValueError):
    """The directory holds KV for another model or layout (or is not a tier directory at all)."""


class TierLockedError(ValueError):
    """Another process (or another DiskTier in this one) uses the directory."""


def entry_header(key: bytes, payload_len: int) -> bytes:
    """The 48 header bytes before the checksum."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(key), payload_len, key)


def entry_checksum(header: bytes, payload: bytes | memoryview) -> bytes:
    hasher = xxhash.xxh3_128(header)
    hasher.update(payload)
    return hasher.digest()


def entry_problem(key: bytes, head: bytes, payload: bytes | memoryview, payload_len: int) -> str | None:
    """Why the file holding (head, payload) is not a valid entry for key, or None if it is."""
    if len(head) != HEADER_BYTES or len(payload) != payload_len:
        return f"size: header {len(head)} B, payload {len(payload)} B, expected {HEADER_BYTES} + {payload_len} B"
    magic, version, key_len, stored_len, stored_key = HEADER.unpack_from(head)
    if magic != MAGIC:
        return f"not an entry (magic {magic!r})"
    if version != FORMAT_VERSION:
        return f"entry format version {version}, expected {FORMAT_VERSION}"
    if stored_len != payload_len:
        return f"payload length {stored_len} in header, expected {payload_len}"
    if key_len > MAX_KEY_BYTES or stored_key[:key_len] != key:
        return "holds another key"
    if entry_checksum(head[: HEADER.size], payload) != head[HEADER.size :]:
        return "checksum mismatch"
    return None


def _key_of(name: str) -> bytes | None:
    """The key an entry file name spells (its hex), or None for any other file."""
    if not 2 <= len(name) <= 2 * MAX_KEY_BYTES or len(name) % 2:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


class DiskTier:
    """A KVTier in a directory (see the module docstring for the layout), for one process at a time.

    DiskTier(path, capacity_bytes, manifest, on_mismatch="refuse", fsync=False)
    - path: the directory, created if missing. A new or empty directory gets `manifest` written into it.
    - capacity_bytes: bound on the summed size of the entry files (header + payload, i.e. what the entries take on
      disk; temp files of writes in flight come on top). Least recently used entries are deleted to stay within
      it, at open too (a restart with a smaller capacity). stats.bytes counts payload bytes only.
    - on_mismatch: what to do with a directory whose manifest differs from `manifest`, is unreadable, or that is
      missing while the directory holds other files. "refuse" raises TierMismatchError naming the directory and
      every differing field. "ignore" logs a warning and leaves the directory exactly as it is: the tier is then
      disabled (holds nothing, stores nothing, never reads, writes, locks or deletes anything there).
    - Raises TierLockedError (with the holder's pid) if another DiskTier, in any process, has the directory open.

    put stores best effort: a write that fails (a full disk) is logged (once per kind of error) and dropped, never
    raised; only a caller's mistake (a payload of the wrong length, a key that is not 1 to 32 bytes) raises
    ValueError.

    Thread-safe: one lock guards the index and the counters; the file I/O of get and put runs outside it, so a
    background writer does not stall the engine thread's contains/get. After close(), or when disabled, contains
    is False, get is None (a miss) and put does nothing.

    Counters: every get is exactly one of hits, misses (absent) or corrupt (found damaged, file deleted).
    bytes_read / bytes_written count file bytes moved (header included), with read_seconds / write_seconds.
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        manifest: TierManifest,
        on_mismatch: MismatchPolicy = "refuse",
        fsync: bool = False,
    ) -> None:
        if on_mismatch not in ("refuse", "ignore"):
            raise ValueError(f"on_mismatch must be 'refuse' or 'ignore', not {on_mismatch!r}")
        if manifest.payload_bytes <= 0:
            raise ValueError(f"manifest.payload_bytes must be > 0 (chunk_tokens x bytes_per_token), not {manifest}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, not {capacity_bytes}")
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.manifest = manifest
        self.stats = TierStats()
        self.fsync = fsync
        self.entry_bytes = HEADER_BYTES + manifest.payload_bytes  # the size of every entry file
        self.disabled_reason: str | None = None  # set when on_mismatch="ignore" had to ignore the directory
        self._index: OrderedDict[bytes, None] = OrderedDict()  # keys held, least recently used first
        self._lock = threading.Lock()
        self._writes_done = threading.Condition(self._lock)
        self._writes_in_flight = 0
        self._closed = False
        self._clock = 0  # last mtime stamped (ns): stamps strictly increase, so mtimes order the entries exactly
        self._temp_serial = 0
        self._lock_file: int | None = None
        self._write_errors: set[int | None] = set()  # errnos of failed writes already logged at warning level

        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"KV tier directory {self.path} exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        # Look before locking: a foreign directory is refused or ignored without creating anything in it.
        if self._check_manifest(on_mismatch):
            return
        self._take_lock()
        try:
            if self._check_manifest(on_mismatch):  # again under the lock: another process may have just set it up
                self._release_lock()
                return
            if not (self.path / MANIFEST_NAME).exists():
                self._write_manifest()
            self._open_entries()
        except BaseException:
            self._release_lock()
            raise
        if self.entry_bytes > self.capacity_bytes:
            logger.warning(
                "KV tier %s: capacity %d B is below one entry (%d B): nothing will be stored",
                self.path,
                self.capacity_bytes,
                self.entry_bytes,
            )

    # ---- KVTier ----

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._index:
                self.stats.misses += 1
                return None
        start = time.perf_counter()
        path = self._entry_path(key)
        head, payload = b"", b""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == self.entry_bytes:
                    head, payload = f.read(HEADER_BYTES), f.read(self.manifest.payload_bytes)
                    problem = entry_problem(key, head, payload, self.manifest.payload_bytes)
                else:
                    problem = f"file is {size} B, expected {self.entry_bytes} B"
        except FileNotFoundError:  # evicted or dropped by another thread since the check above
            with self._lock:
                self.stats.misses += 1
            return None
        except OSError as e:
            problem = f"unreadable ({e})"
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.bytes_read += len(head) + len(payload)
            self.stats.read_seconds += elapsed
            if problem is not None:
                self.stats.corrupt += 1
                self._drop(key)
                logger.warning("KV tier %s: dropped damaged entry %s: %s", self.path, path.name, problem)
                return None
            self.stats.hits += 1
            if key in self._index:  # else evicted while we read: the payload we hold is still valid
                self._index.move_to_end(key)
                self._stamp(path)
        return payload

    def put(self, key: bytes, payload: bytes) -> None:
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a tier key is 1 to {MAX_KEY_BYTES} bytes, got {key!r:.80}")
        view = memoryview(payload).cast("B")  # any C-contiguous buffer, as its bytes
        if view.nbytes != self.manifest.payload_bytes:
            raise ValueError(
                f"payload is {view.nbytes} B; this tier stores exactly {self.manifest.payload_bytes} B per entry "
                f"({self.manifest.chunk_tokens} tokens x {self.manifest.bytes_per_token} B)"
            )
        path = self._entry_path(key)
        with self._lock:
            if self._closed or self.disabled_reason is not None or self.entry_bytes > self.capacity_bytes:
                return
            if key in self._index:
                self._index.move_to_end(key)
                self._stamp(path)
                return
            self._writes_in_flight += 1
            self._temp_serial += 1
            temp = path.parent / f".{path.name}.{os.getpid()}.{self._temp_serial}{TEMP_SUFFIX}"
        try:
            start = time.perf_counter()
            self._write_file(temp, key, view)
            elapsed = time.perf_counter() - start
            with self._lock:
                self.stats.bytes_written += self.entry_bytes
                self.stats.write_seconds += elapsed
                if self._closed or key in self._index:  # closed meanwhile, or another thread stored it first
                    _unlink(temp)
                    return
                while self._index and (len(self._index) + 1) * self.entry_bytes > self.capacity_bytes:
                    self._evict_oldest()
                self._stamp(temp)
                os.replace(temp, path)
                self._index[key] = None
                self._update_sizes()
        except OSError as e:  # a full or failing disk: storing is best effort, the caller recomputes on a miss
            _unlink(temp)
            self._report_write_error(e)
        except BaseException:
            _unlink(temp)
            raise
        finally:
            with self._lock:
                self._writes_in_flight -= 1
                self._writes_done.notify_all()

    def close(self) -> None:
        """Wait for writes in flight, then release the directory (the lock file stays; its flock is what counts)."""
        with self._lock:
            self._closed = True
            while self._writes_in_flight:
                self._writes_done.wait()
            self._index.clear()
        self._release_lock()

    def describe(self) -> dict:
        """A JSON-able summary for /load, metrics and the CLI."""
        with self._lock:
            state = "closed" if self._closed else "ignored" if self.disabled_reason else "ready"
            return {
                "name": self.name,
                "path": str(self.path),
                "state": state,
                "disabled_reason": self.disabled_reason,
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": len(self._index) * self.entry_bytes,
                "entry_bytes": self.entry_bytes,
                "manifest": self.manifest.to_dict(),
                "stats": asdict(self.stats),
            }

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- opening ----

    def _check_manifest(self, on_mismatch: MismatchPolicy) -> bool:
        """True if the directory is foreign and ignored (the tier is then disabled); raises if refused."""
        differences = self._manifest_differences()
        if not differences:
            return False
        advice = "use another KV offload directory, or delete this one to start it afresh"
        if on_mismatch == "refuse":
            raise TierMismatchError(
                f"KV tier directory {self.path} does not hold KV for this server ({'; '.join(differences)}; "
                f"values: this server's != the directory's): {advice}"
            )
        self.disabled_reason = "; ".join(differences)
        logger.warning(
            "KV tier directory %s does not hold KV for this server (%s): ignoring it (the tier stays empty and "
            "nothing in it is read, written or deleted); %s",
            self.path,
            self.disabled_reason,
            advice,
        )
        return True

    def _manifest_differences(self) -> list[str]:
        """What differs between the directory's manifest and ours ('field: this server != directory'); empty if
        they match or the directory is new (no manifest and nothing but our own lock and temp files)."""
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.exists():
            others = [p.name for p in self.path.iterdir() if p.name != LOCK_NAME and not _is_temp(p.name)]
            return [f"no {MANIFEST_NAME} but other files ({', '.join(sorted(others)[:5])})"] if others else []
        try:
            stored = json.loads(manifest_path.read_text())
            if not isinstance(stored, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return [f"{MANIFEST_NAME} unreadable ({e})"]
        if stored.pop("format", None) != FORMAT:
            return [f"{MANIFEST_NAME} is not a {FORMAT} manifest"]
        if stored.pop("format_version", None) != FORMAT_VERSION:
            return [f"directory format version is not {FORMAT_VERSION}"]
        names = [f.name for f in fields(TierManifest)]
        if set(stored) == set(names):
            return self.manifest.differences(TierManifest(**stored))
        ours = self.manifest.to_dict()
        odd = sorted(set(names) ^ set(stored))  # fields one side lacks (a manifest of another prefixkv version)
        return [f"{k}: {ours.get(k, '(absent)')!r} != {stored.get(k, '(absent)')!r}" for k in odd]

    def _write_manifest(self) -> None:
        content = {"format": FORMAT, "format_version": FORMAT_VERSION, **self.manifest.to_dict()}
        temp = self.path / f".{MANIFEST_NAME}.{os.getpid()}{TEMP_SUFFIX}"
        temp.write_text(json.dumps(content, indent=2) + "\n")
        os.replace(temp, self.path / MANIFEST_NAME)

    def _take_lock(self) -> None:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise TierLockedError(
                    f"KV tier directory {self.path} is in use by another server (pid {holder}): one process per "
                    "directory; give this one another directory"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_file = fd

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # closing the descriptor drops the flock
            self._lock_file = None

    def _open_entries(self) -> None:
        """Index the entries on disk (LRU order from mtimes), remove stale temp files and entries of the wrong
        size, then evict down to capacity. Headers and checksums are checked by get, not here (a full read)."""
        found: list[tuple[int, str, bytes]] = []
        for folder in self.path.iterdir():
            if _is_temp(folder.name):
                _unlink(folder)
            if not folder.is_dir() or len(folder.name) != 2 or _key_of(folder.name) is None:
                continue
            with os.scandir(folder) as it:
                for item in it:
                    if _is_temp(item.name):
                        _unlink(Path(item.path))
                        continue
                    key = _key_of(item.name)
                    if key is None or not item.name.startswith(folder.name) or not item.is_file():
                        continue
                    st = item.stat()
                    if st.st_size != self.entry_bytes:
                        self.stats.corrupt += 1
                        _unlink(Path(item.path))
                        logger.warning(
                            "KV tier %s: dropped damaged entry %s: file is %d B, expected %d B",
                            self.path,
                            item.name,
                            st.st_size,
                            self.entry_bytes,
                        )
                        continue
                    found.append((st.st_mtime_ns, item.name, key))
        found.sort()
        for mtime, _, key in found:
            self._index[key] = None
            self._clock = max(self._clock, mtime)
        while self._index and len(self._index) * self.entry_bytes > self.capacity_bytes:
            self._evict_oldest()
        self._update_sizes()

    # ---- helpers (callers hold self._lock where the index or the counters are touched) ----

    def _entry_path(self, key: bytes) -> Path:
        name = key.hex()
        return self.path / name[:2] / name

    def _write_file(self, temp: Path, key: bytes, payload: memoryview) -> None:
        temp.parent.mkdir(exist_ok=True)
        head = entry_header(key, payload.nbytes)
        with open(temp, "xb") as f:
            f.write(head)
            f.write(entry_checksum(head, payload))
            f.write(payload)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _report_write_error(self, error: OSError) -> None:
        """Warn once per kind of error (a full disk would otherwise log every put), then at debug level."""
        with self._lock:
            first = error.errno not in self._write_errors
            self._write_errors.add(error.errno)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "KV tier %s: an entry was not stored: %s", self.path, error)

    def _stamp(self, path: Path) -> None:
        """Set path's mtime to a time later than every stamp before it (best effort: recency is only a hint)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        try:
            os.utime(path, ns=(self._clock, self._clock))
        except OSError:
            pass

    def _evict_oldest(self) -> None:
        key, _ = self._index.popitem(last=False)
        _unlink(self._entry_path(key))
        self.stats.evicted += 1
        self._update_sizes()

    def _drop(self, key: bytes) -> None:
        self._index.pop(key, None)
        _unlink(self._entry_path(key))
        self._update_sizes()

    def _update_sizes(self) -> None:
        self.stats.entries = len(self._index)
        self.stats.bytes = len(self._index) * self.manifest.payload_bytes


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("KV tier: could not delete %s: %s", path, e)
