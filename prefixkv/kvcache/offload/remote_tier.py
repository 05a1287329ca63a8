"""A KV tier on a shared store (Redis): a chunk one replica computed is loaded by every replica of the same model.

Why Redis (docs/kv_remote.md has the comparison): Debian ships it (`redis-server`, no build), one process holds
binary values of megabytes in RAM and serves them over TCP at about a GB/s on one machine, it evicts least
recently used values within `maxmemory` by itself, and many operators already run one. What prefixkv needs of it is
only GET, SET NX, EXISTS and DEL.

Names: "prefixkv:<manifest digest>:<chunk key hex>". The chunk key is the hash chain over the prefix (hashing.py:
the cache salt and the adapter are inside it, so a tenant's lookup can never name another tenant's chunk); the
manifest digest (xxh3-64 over the TierManifest: the model's weights, dtype, chunk size, layout, the kernels that
computed the KV) makes two models, or two builds whose KV differs in its bits, use different names. Replicas agree
on every name without talking to each other.

Values: the manifest's xxh3-128 digest (16 bytes), then the disk tier's entry (disk_tier.py: a 64-byte header with
the key, the length and an xxh3-128 checksum, then the payload). A value cut short, failing its checksum, holding
another key (counted `corrupt`, and deleted so a replica can store it again) or written for another manifest
(`foreign`) is a miss: the engine recomputes, never serves it.

Writes run on the engine's writer thread (writer.py: a bounded queue, a save that finds it full is dropped and
counted), so a step never waits on a write. A chunk already in the store is not sent again: EXISTS first
(`already_stored`), then SET NX, so when two replicas race, the second write stores nothing.

Load or recompute: the engine measures how long its prefill takes a token (the tier copier, around each forward
pass of a chunk or more: recompute_seconds_per_token), the tier how long a chunk read takes. Where reading a chunk
is slower than recomputing it on this CPU (a small model, a store far away or busy), contains() answers no, so the
chunk is recomputed (counted `skipped_recompute_cheaper`); one call in PROBE_EVERY still reads, so the measurement
follows the store.

The store failing: every call has a timeout: `timeout_s` for reads and writes, and at most PROBE_TIMEOUT_S for
EXISTS, which the engine thread asks in its lookups and commits (a step waits on a store that stopped answering
for that long at most, once). A connection error or a timeout marks the store down: for `retry_s` after it every
call answers a miss at once, then the next call tries again. A write the store refuses (full: `maxmemory` with the
noeviction policy) is counted `refused`. `health()` says why the tier is degraded, the log says it once per
outage, `stats` count it all.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from prefixkv.kvcache.offload.disk_tier import HEADER_BYTES, entry_checksum, entry_header, entry_problem
from prefixkv.kvcache.offload.tier import TierManifest, TierStats

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_RETRY_S = 5.0
PROBE_EVERY = 32  # with recompute measured cheaper, one contains() in this many still asks the store
PROBE_TIMEOUT_S = 0.1  # EXISTS on the engine thread: ~0.1 ms on one machine, a few ms across a datacenter

T = TypeVar("T")


def manifest_digest(manifest: TierManifest) -> bytes:
    """xxh3-128 over the manifest's fields as sorted JSON: equal exactly when two tiers' KV is interchangeable."""
    return xxhash.xxh3_128(json.dumps(manifest.to_dict(), sort_keys=True).encode()).digest()


def encode_value(digest: bytes, key: bytes, payload: bytes) -> bytes:
    """What the store holds for a chunk: the manifest digest, then the disk tier's entry (header, payload)."""
    header = entry_header(key, len(payload))
    return b"".join((digest, header, entry_checksum(header, payload), payload))


@dataclass(slots=True)
class RemoteStats:
    """What only a shared store can do wrong or right, beside TierStats (exported on /metrics)."""

    already_stored: int = 0  # puts skipped: another replica (or this one) had stored the chunk
    refused: int = 0  # puts the store refused (full)
    foreign: int = 0  # values written for another manifest (model, dtype, layout, kernels): read as misses
    unreachable: int = 0  # calls that failed on the connection or timed out
    skipped_down: int = 0  # calls answered as misses at once because the store was down
    skipped_recompute_cheaper: int = 0  # chunks not looked up: recomputing one was measured faster than reading it
    outages: int = 0  # times the store went from up to down


class StoreDown(Exception):
    """The store did not answer (connection refused or lost, timeout)."""


class RedisTier:
    """KVTier on a Redis server (see the module docstring). RedisTier(url, manifest, timeout_s, retry_s).

    url: redis://[user:password@]host:port[/db] (or rediss:// for TLS, unix:// for a socket). The store is not
    required to be up at start: a replica started before its store serves on, recomputing, and finds it later.
    capacity_bytes is the store's maxmemory (0 when unbounded or not readable). stats.entries / stats.bytes count
    the chunks this replica stored; the store's own size is the store's (INFO memory).
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        manifest: TierManifest,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis  # only a deployment with a shared tier needs the client

        if timeout_s <= 0:
            raise ValueError(f"kv_remote_timeout must be > 0 seconds, got {timeout_s}")
        self.url = url
        self.manifest = manifest
        self.stats = TierStats()
        self.remote = RemoteStats()
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.digest = manifest_digest(manifest)
        self.prefix = f"prefixkv:{self.digest[:8].hex()}:".encode()
        self._clock = clock
        # what the store answering badly raises: a refusal (ResponseError: full, a wrong type), else an outage
        self._response_error = redis.ResponseError
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        probe_s = min(timeout_s, PROBE_TIMEOUT_S)
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._probe = redis.Redis.from_url(url, socket_timeout=probe_s, socket_connect_timeout=probe_s)
        except ValueError as e:
            raise ValueError(f"kv_remote {url!r} is not a Redis URL: {e}") from None
        self._lock = threading.Lock()  # guards the counters and the down state (three threads use the tier)
        self._down_until = 0.0
        self.down_reason: str | None = None
        self._closed = False
        self.recompute_seconds_per_token: float | None = None  # the engine's prefill rate here, once measured
        self._contains_calls = 0
        self.capacity_bytes = self._call(self._maxmemory, 0)

    # ---- the store's state ----

    def health(self) -> str | None:
        """None while the store answers; why the tier is degraded otherwise (once retry_s has passed, asking
        pings the store, so an idle replica finds it back too)."""
        if self.down_reason is not None and self._clock() >= self._down_until:
            self._call(self._probe.ping, False)
        return self.down_reason

    def report(self) -> dict[str, Any]:
        """The store's counters as EngineStats' kv_remote_* fields (asks health() first)."""
        down = self.health()
        s, r = self.stats, self.remote
        return dict(
            kv_remote_status="ok" if down is None else f"degraded: {down}",
            kv_remote_hits=s.hits,
            kv_remote_misses=s.misses,
            kv_remote_stored=s.entries,
            kv_remote_already_stored=r.already_stored,
            kv_remote_refused=r.refused,
            kv_remote_foreign=r.foreign,
            kv_remote_corrupt=s.corrupt,
            kv_remote_unreachable=r.unreachable,
            kv_remote_outages=r.outages,
            kv_remote_skipped_recompute_cheaper=r.skipped_recompute_cheaper,
            kv_remote_bytes_read=s.bytes_read,
            kv_remote_bytes_written=s.bytes_written,
            kv_remote_read_seconds=s.read_seconds,
        )

    def _call(self, fn: Callable[[], T], down_value: T, raise_refusal: bool = False) -> T:
        """fn() against the store; down_value at once while it is down, or when the call fails on the
        connection (which marks it down for retry_s). A refusal (the store answered with an error) is
        down_value too, logged, or raised with raise_refusal."""
        if self._closed:
            return down_value
        if self.down_reason is not None and self._clock() < self._down_until:
            with self._lock:
                self.remote.skipped_down += 1
            return down_value
        try:
            result = fn()
        except self._response_error as e:
            if raise_refusal:
                raise
            logger.warning("KV tier remote %s refused a call: %s", self.url, e)
            return down_value
        except self._errors as e:
            self._mark_down(f"{type(e).__name__}: {e}")
            return down_value
        if self.down_reason is not None:
            logger.warning("KV tier remote %s: the store answers again (down since: %s)", self.url, self.down_reason)
            self.down_reason = None
        return result

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            self.remote.unreachable += 1
            self._down_until = self._clock() + self.retry_s
            if self.down_reason is None:
                self.remote.outages += 1
                self.down_reason = reason
                logger.warning(
                    "KV tier remote %s is unreachable (%s): serving on, recomputing what it holds; retrying every "
                    "%.0f s",
                    self.url,
                    reason,
                    self.retry_s,
                )

    def _maxmemory(self) -> int:
        try:
            value: Any = self._client.config_get("maxmemory").get("maxmemory", 0)
        except self._response_error:  # CONFIG may be disabled on a managed store
            return 0
        return int(value or 0)

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    # ---- KVTier ----

    def read_seconds_per_chunk(self) -> float | None:
        """A chunk read and verified, on average so far (None before the first hit)."""
        return self.stats.read_seconds / self.stats.hits if self.stats.hits else None

    def cheaper_to_recompute(self) -> bool:
        """Whether reading a chunk has been measured slower than recomputing its tokens here."""
        read_s, token_s = self.read_seconds_per_chunk(), self.recompute_seconds_per_token
        return read_s is not None and token_s is not None and read_s > token_s * self.manifest.chunk_tokens

    def contains(self, key: bytes) -> bool:
        self._contains_calls += 1
        if self.cheaper_to_recompute() and self._contains_calls % PROBE_EVERY:
            with self._lock:
                self.remote.skipped_recompute_cheaper += 1
            return False
        return bool(self._call(lambda: self._probe.exists(self._name(key)), 0))

    def get(self, key: bytes) -> bytes | None:
        started = time.perf_counter()
        refusal: str | None = None
        try:
            value: Any = self._call(lambda: self._client.get(self._name(key)), None, raise_refusal=True)
        except self._response_error as e:  # not a string value (WRONGTYPE): damaged like a cut one
            value, refusal = b"", str(e)
        seconds = time.perf_counter() - started
        if value is None:
            with self._lock:
                self.stats.misses += 1
            return None
        payload, problem = self._decode(key, value)
        problem = refusal or problem
        with self._lock:
            self.stats.read_seconds += seconds
            self.stats.bytes_read += len(value)
            if payload is not None:
                self.stats.hits += 1
                return payload
            if problem == "foreign":
                self.remote.foreign += 1
            else:
                self.stats.corrupt += 1
        if problem != "foreign":  # a damaged value would block every later SET NX of the chunk
            logger.warning("KV tier remote: dropped a damaged chunk (%s)", problem)
            self._call(lambda: self._client.delete(self._name(key)), 0)
        return None

    def _decode(self, key: bytes, value: bytes) -> tuple[bytes | None, str | None]:
        """(payload, None) for a valid value of this manifest and key, else (None, why)."""
        if len(value) >= DIGEST_BYTES and value[:DIGEST_BYTES] != self.digest:
            return None, "foreign"
        body = memoryview(value)[DIGEST_BYTES:]
        head, payload = body[:HEADER_BYTES], body[HEADER_BYTES:]
        problem = entry_problem(key, bytes(head), payload, self.manifest.payload_bytes)
        return (bytes(payload), None) if problem is None else (None, problem)

    def put(self, key: bytes, payload: bytes) -> None:
        if len(payload) != self.manifest.payload_bytes:
            raise ValueError(f"a payload must be {self.manifest.payload_bytes} bytes, got {len(payload)}")
        name = self._name(key)
        if self._call(lambda: self._client.exists(name), 1):  # held, or the store is down: nothing to send
            if self.down_reason is None:
                with self._lock:
                    self.remote.already_stored += 1
            return
        value = encode_value(self.digest, key, payload)
        started = time.perf_counter()
        try:
            stored = self._call(lambda: self._client.set(name, value, nx=True), None, raise_refusal=True)
        except self._response_error as e:  # OOM: the store is full and evicts nothing
            with self._lock:
                self.remote.refused += 1
            logger.debug("KV tier remote: a write was refused (%s)", e)
            return
        with self._lock:
            if stored:
                self.stats.entries += 1
                self.stats.bytes += len(payload)
                self.stats.bytes_written += len(value)
                self.stats.write_seconds += time.perf_counter() - started
            elif stored is not None:  # SET NX lost a race with another replica's write
                self.remote.already_stored += 1

    def close(self) -> None:
        """Stop using the store (what it holds stays for the other replicas)."""
        self._closed = True
        self._client.close()
        self._probe.close()
