"""A KV tier in host RAM: the second tier of a GPU deployment (device memory is the pool), and the tier tests use.

An LRU map key -> payload under one lock (the engine's writer thread puts while the engine thread gets). Nothing
outlives the process, so there is no checksum: a payload is the bytes that were put.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from prefixkv.kvcache.offload.tier import TierManifest, TierStats


class HostTier:
    """KVTier in RAM, capacity_bytes of payloads at most, least recently used dropped first."""

    name = "host"

    def __init__(self, capacity_bytes: int, manifest: TierManifest) -> None:
        if capacity_bytes < manifest.payload_bytes:
            raise ValueError(
                f"kv_offload_host_size must hold at least one chunk ({manifest.payload_bytes} bytes), "
                f"got {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.manifest = manifest
        self.stats = TierStats()
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: bytes) -> bytes | None:
        started = time.perf_counter()
        with self._lock:
            payload = self._entries.get(key)
            if payload is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
            self.stats.read_seconds += time.perf_counter() - started
            return payload

    def put(self, key: bytes, payload: bytes) -> None:
        if len(payload) != self.manifest.payload_bytes:
            raise ValueError(f"a payload must be {self.manifest.payload_bytes} bytes, got {len(payload)}")
        started = time.perf_counter()
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            while self.stats.bytes + len(payload) > self.capacity_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.stats.bytes -= len(dropped)
                self.stats.entries -= 1
                self.stats.evicted += 1
            self._entries[key] = bytes(payload)
            self.stats.entries += 1
            self.stats.bytes += len(payload)
            self.stats.bytes_written += len(payload)
            self.stats.write_seconds += time.perf_counter() - started

    def close(self) -> None:
        """Nothing pending (put is synchronous); the entries stay readable for a new engine on this tier."""
