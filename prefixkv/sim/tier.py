"""The second KV tier in a simulation: the engine's own tiered cache over a tier that holds keys, not bytes, and
charges simulated time for what it moves.

The cache is the engine's (kvcache/offload/tiered_cache.py: the same lookups, loads, write policies and
verification path); only the tier and the copier differ. A SimStore keeps each chunk's key with the simulated time
its write completes, LRU within a capacity in tokens; a SimTier is one engine's access to a store (its own, for a
local tier; one store shared by every replica's SimTier for the shared tier, sim/shared_tier.py) and models one
read channel and one write channel at the TierCost's bandwidths:
- a read the engine makes while scheduling a step (a lookup's probe, an admission's load) waits for the read
  channel and is charged to that step: SimTierCopier adds the wait to the clock before the step's compute;
- a read started ahead (at a request's arrival, as the engine's prefetch thread does, or before an agent's pause
  ends, sim/sessions.py) runs on the same channel in the background: the step that takes it waits only for what
  is left of it;
- a write runs in the background (the engine's writer thread); the chunk is readable once it is done, and a write
  that finds more than the writer's queue bound pending is dropped, as TierWriter drops it;
- asking whether the tier holds a chunk costs the cost's op_latency_s on the engine thread (a store's EXISTS round
  trip; 0 for a local tier, a dict or a file lookup): charged to the step as a read's wait is.
Not modelled: the copy between staging and the pool (a memcpy on a CPU; on a GPU it is the PCIe transfer this
read bandwidth stands for) and the staging bound (a simulated payload is a few bytes).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.kvcache.offload.tier import TierManifest, TierStats
from prefixkv.kvcache.offload.tiered_cache import TieredKVCache
from prefixkv.kvcache.offload.writer import DEFAULT_PENDING_BYTES
from prefixkv.request import Request
from prefixkv.sim.cost_model import load_preset_or_file

TIER_MEDIUMS = ("host", "disk", "remote")


@dataclass(frozen=True)
class TierCost:
    """What moving KV between the pool and the tier costs: bytes of KV per token, the two bandwidths, and a
    store's round trip (op_latency_s) for each question the engine thread asks it."""

    name: str
    source: str  # where the figures come from (a measurement on which machine, or published figures)
    medium: str  # "host" | "disk" | "remote" (a shared store)
    kv_bytes_per_token: int  # K and V of one token over all layers
    read_bytes_per_s: float  # tier -> pool
    write_bytes_per_s: float  # pool -> tier
    # one contains() (a store's EXISTS) on the engine thread; the reads' and writes' own round trips are inside
    # their rates, which are measured per chunk. 0: a local tier, whose lookups cost nothing next to a step
    op_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.medium not in TIER_MEDIUMS:
            raise ValueError(
                f"tier cost {self.name!r}: medium must be one of {', '.join(TIER_MEDIUMS)}, got {self.medium!r}"
            )
        for key in ("kv_bytes_per_token", "read_bytes_per_s", "write_bytes_per_s", "op_latency_s"):
            value = getattr(self, key)
            floor_ok = key == "op_latency_s"  # a round trip may be 0; a size or a rate may not
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (value == 0 and not floor_ok)
            ):
                bound = ">= 0" if floor_ok else "> 0"
                raise ValueError(f"tier cost {self.name!r}: {key} must be a finite number {bound}, got {value!r}")

    def read_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.read_bytes_per_s

    def write_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.write_bytes_per_s

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _llama3_host(name: str, params: str, layers: int, gpus: int, link: str, link_bytes_per_s: float) -> TierCost:
    """Host RAM behind each GPU's PCIe link (tensor parallel: every GPU moves its share of the heads at once)."""
    per_token = layers * 8 * 128 * 2 * 2  # 8 KV heads of 128, K and V, bf16
    rate = gpus * link_bytes_per_s / 2
    source = (
        f"derived, not measured: Llama 3 {params} KV is {layers} layers x 8 KV heads x 128 x (K, V) x 2 bytes = "
        f"{per_token} bytes a token (Meta's model card); {gpus} x {link} at {link_bytes_per_s / 1e9:g} GB/s a "
        "direction (PCI-SIG), taken at half for paged (scattered) block copies"
    )
    return TierCost(name, source, "host", per_token, rate, rate)


# measured on this machine with the engine's own disk tier (docs/benchmarks/agent_traces/README.md says how)
_SMOLLM2_DISK_AMD_EPYC = TierCost(
    name="smollm2-disk-amd-epyc",
    source=(
        "this 2-core machine (AMD EPYC): SmolLM2-135M bf16 KV is 30 layers x 3 KV heads x 64 x (K, V) x 2 bytes = "
        "23,040 bytes a token. Read: 1,529 MB/s, a 256-token chunk read, verified and copied into the pool on the "
        "model (`prefixkv bench restart`, 2026-11-30, docs/benchmarks/kv_offload). Write: DiskTier.put of 64 "
        "256-token chunks, median of 3 rounds 2,709 MB/s (594 MB/s in the first, cold round), 2026-12-02. Both "
        "from the page cache: a drive's own speed is not measured"
    ),
    medium="disk",
    kv_bytes_per_token=23_040,
    read_bytes_per_s=1.529e9,
    write_bytes_per_s=2.709e9,
)


def _smollm2_redis(
    chunk_tokens: int, read_bytes_per_s: float, write_bytes_per_s: float, read_ms: float, write_ms: float
) -> TierCost:
    """The shared store (a Redis server) as prefixkv's RedisTier reaches it on this machine, at one chunk size."""
    chunk_mb = chunk_tokens * 23_040 / 1e6
    source = (
        f"measured on this 2-core machine (AMD EPYC Zen 5, family 26) through prefixkv's RedisTier against a local "
        f"redis-server 7.0, SmolLM2-135M bf16 KV (23,040 bytes a token), {chunk_tokens}-token chunks "
        f"({chunk_mb:.2f} MB): a write (EXISTS, then SET NX) {write_ms:g} ms = {write_bytes_per_s / 1e6:g} MB/s, "
        f"a read (GET, then the checksum verified) {read_ms:g} ms = {read_bytes_per_s / 1e6:g} MB/s; an EXISTS "
        "round trip 107 us (op_latency_s). One client: the server's own contention between replicas is not in "
        "these figures"
    )
    suffix = "" if chunk_tokens == 16 else f"-{chunk_tokens}"
    return TierCost(
        f"smollm2-redis-amd-epyc{suffix}", source, "remote", 23_040, read_bytes_per_s, write_bytes_per_s, 107e-6
    )


# the shared tier's presets, by the chunk size they were measured at (shared_tier.py picks the nearest)
REDIS_PRESETS_BY_CHUNK = {
    16: _smollm2_redis(16, 470e6, 738e6, 0.78, 0.50),
    256: _smollm2_redis(256, 412e6, 955e6, 14.3, 6.2),
}

TIER_PRESETS: dict[str, TierCost] = {
    t.name: t
    for t in (
        _SMOLLM2_DISK_AMD_EPYC,
        *REDIS_PRESETS_BY_CHUNK.values(),
        _llama3_host("llama3-8b-host-pcie5", "8B", 32, 1, "PCIe 5.0 x16", 64e9),
        _llama3_host("llama3-8b-host-pcie4", "8B", 32, 1, "PCIe 4.0 x16", 32e9),
        _llama3_host("llama3-70b-host-pcie5x4", "70B", 80, 4, "PCIe 5.0 x16", 64e9),
    )
}
# the tier each step cost preset (cost_model.PRESETS) runs with by default; a fitted model: this CPU's disk
DEFAULT_TIER_COST = {
    "llama3-8b-h100": "llama3-8b-host-pcie5",
    "llama3-8b-a100": "llama3-8b-host-pcie4",
    "llama3-70b-h100x4": "llama3-70b-host-pcie5x4",
}


def load_tier_cost(name_or_path: str) -> TierCost:
    """A preset by name, else a JSON file of TierCost's fields; ValueError saying what is wrong."""
    return load_preset_or_file(name_or_path, "tier cost", TIER_PRESETS, _tier_cost_from_json)


def _tier_cost_from_json(data: object) -> TierCost:
    known = [f.name for f in fields(TierCost)]
    required = [name for name in known if name != "op_latency_s"]  # files written before it have none: 0
    if not isinstance(data, dict) or not set(required) <= set(data) <= set(known):
        raise ValueError(f"expected a JSON object with exactly {', '.join(required)} (and optionally op_latency_s)")
    return TierCost(**data)


def default_tier_cost(step_cost_name: str) -> TierCost:
    return TIER_PRESETS[DEFAULT_TIER_COST.get(step_cost_name, _SMOLLM2_DISK_AMD_EPYC.name)]


class SimStore:
    """The chunks a simulated tier holds: each key with the simulated time its write completes, least recently used
    first, within a capacity in tokens (one simulated byte a token). A local tier has one of its own; the shared
    tier is one store that every replica's SimTier reads and writes (sim/shared_tier.py)."""

    def __init__(self, capacity_tokens: int, chunk_tokens: int) -> None:
        if capacity_tokens < chunk_tokens:
            raise ValueError(f"the tier must hold at least one {chunk_tokens}-token chunk, got {capacity_tokens}")
        self.capacity_tokens, self.chunk_tokens = capacity_tokens, chunk_tokens
        self.stats = TierStats()  # entries, bytes (tokens) held and evicted: the store's own
        self._written_at: OrderedDict[bytes, float] = OrderedDict()  # key -> when its write completes, LRU order

    def readable(self, key: bytes, now: float) -> bool:
        written = self._written_at.get(key)
        return written is not None and written <= now

    def held(self, key: bytes) -> bool:
        """Stored or being written (a second write of it stores nothing)."""
        return key in self._written_at

    def written_at(self, key: bytes) -> float | None:
        return self._written_at.get(key)

    def keys(self) -> list[bytes]:
        """Every chunk stored or being written, least recently used first."""
        return list(self._written_at)

    def touch(self, key: bytes) -> None:
        self._written_at.move_to_end(key)

    def add(self, key: bytes, now: float, done: float) -> list[bytes]:
        """Store `key` (written from `now`, readable from `done`), evicting least recently used chunks for room at
        once; the evicted keys."""
        evicted = []
        while self.stats.bytes + self.chunk_tokens > self.capacity_tokens:
            dropped, _ = self._written_at.popitem(last=False)
            evicted.append(dropped)
            self.stats.bytes -= self.chunk_tokens
            self.stats.entries -= 1
            self.stats.evicted += 1
            self.on_evicted(dropped, now)
        self._written_at[key] = done
        self.stats.entries += 1
        self.stats.bytes += self.chunk_tokens
        self.on_stored(key, done)
        return evicted

    def on_stored(self, key: bytes, done: float) -> None:
        """A chunk was stored, readable from `done` (the shared store publishes it: shared_tier.py)."""

    def on_evicted(self, key: bytes, at: float) -> None:
        """A chunk was evicted at `at` (the shared store publishes it)."""


class SimTier:
    """KVTier over keys only, on simulated time: a SimStore (its own, or one shared with other replicas), one read
    and one write channel at the cost's bandwidths, a round trip per question asked (module docstring)."""

    def __init__(
        self,
        capacity_tokens: int,
        chunk_tokens: int,
        hash_algo: str,
        cost: TierCost,
        clock: Callable[[], float],
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
        store: SimStore | None = None,
    ) -> None:
        """store: a store shared with other tiers (its capacity then stands, capacity_tokens must equal it);
        without one the tier keeps its own of capacity_tokens."""
        if store is not None and (store.chunk_tokens != chunk_tokens or store.capacity_tokens != capacity_tokens):
            raise ValueError(
                f"a shared store of {store.capacity_tokens} tokens in {store.chunk_tokens}-token chunks, asked for "
                f"{capacity_tokens} in {chunk_tokens}-token chunks"
            )
        self.store = store or SimStore(capacity_tokens, chunk_tokens)
        self.shared = store is not None
        self.name = cost.medium
        self.manifest = TierManifest("simulated", "bfloat16", chunk_tokens, 1, hash_algo, device="sim")
        self.capacity_bytes = capacity_tokens
        # a local tier's counters are its store's; a shared store's replica counts its own reads and writes (and,
        # as RedisTier does, entries / bytes: the chunks it stored), the store its size and evictions
        self.stats = TierStats() if self.shared else self.store.stats
        self.cost, self.clock = cost, clock
        self.max_pending_s = max_pending_bytes / cost.write_bytes_per_s  # the writer queue's bound, in time
        self._payload = bytes(chunk_tokens)
        self._chunk_read_s = cost.read_s(chunk_tokens)
        self._chunk_write_s = cost.write_s(chunk_tokens)
        self._read_ahead: dict[bytes, float] = {}  # key -> when its background read completes
        self._read_free_s = 0.0  # when the read channel is next idle
        self._write_free_s = 0.0
        self.stall_s = 0.0  # the current step's wait for synchronous reads and probes (taken by the copier)
        self.dropped_writes = 0
        self.read_ahead_chunks = 0
        self.probes = 0  # contains() the engine asked: each one round trip to a store

    def contains(self, key: bytes) -> bool:
        """The engine's question (a lookup's, a commit's, a prefetch's): one round trip on the engine thread."""
        if self.cost.op_latency_s:
            self.stall_s += self.cost.op_latency_s
        self.probes += 1
        return self.store.readable(key, self.clock())

    def get(self, key: bytes) -> bytes | None:
        """A synchronous read in the step being scheduled: it waits for the channel (or for its read ahead)."""
        if not self.store.readable(key, self.clock()):
            self.stats.misses += 1
            self._read_ahead.pop(key, None)
            return None
        now = self.clock()
        at = now + self.stall_s
        ahead = self._read_ahead.pop(key, None)
        if ahead is None:
            at = max(at, self._read_free_s) + self._chunk_read_s
            self._read_free_s = at
        else:
            at = max(at, ahead)
        self.stall_s = at - now
        self.store.touch(key)
        self.stats.hits += 1
        self.stats.bytes_read += len(self._payload) * self.cost.kv_bytes_per_token
        return self._payload

    def read_ahead(self, key: bytes) -> None:
        """Start a background read of `key` now (it queues on the read channel); a later get waits for its end."""
        if key in self._read_ahead or not self.store.readable(key, self.clock()):
            return
        done = max(self.clock(), self._read_free_s) + self._chunk_read_s
        self._read_free_s = done
        self._read_ahead[key] = done
        self.read_ahead_chunks += 1

    def put(self, key: bytes, payload: bytes) -> None:
        if len(payload) != self.manifest.payload_bytes:
            raise ValueError(f"a payload must be {self.manifest.payload_bytes} bytes, got {len(payload)}")
        now = self.clock()
        if self.store.held(key):  # stored already (by another replica, for a shared store): only touched
            self.store.touch(key)
            if self.cost.op_latency_s:  # the writer's EXISTS found it
                self._write_free_s = max(now, self._write_free_s) + self.cost.op_latency_s
            return
        if self._write_free_s - now + self._chunk_write_s > self.max_pending_s:  # the writer's queue is full
            self.dropped_writes += 1
            return
        done = max(now, self._write_free_s) + self._chunk_write_s
        self._write_free_s = done
        for dropped in self.store.add(key, now, done):
            self._read_ahead.pop(dropped, None)
        if self.shared:
            self.stats.entries += 1
            self.stats.bytes += len(payload)
        self.stats.bytes_written += len(payload) * self.cost.kv_bytes_per_token

    def take_stall(self) -> float:
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    def close(self) -> None:
        """Nothing to release."""


class SimTierCopier:
    """The engine's TierCopier on simulated time: reads ahead at arrival, charges each step its synchronous reads
    (before the cost model's compute), hands saves to the tier's write channel."""

    def __init__(self, cache: TieredKVCache, tier: SimTier, advance: Callable[[float], None]) -> None:
        """advance: moves the simulated clock forward by that many seconds."""
        self.cache, self.tier, self.advance = cache, tier, advance
        self.stall_s = 0.0

    def on_add(self, request: Request) -> None:
        self.read_ahead(request)

    def read_ahead(self, request: Request) -> int:
        """Start reading the tier's chunks after the pool's hit on request.token_ids; how many were started."""
        keys = self.cache.readable_chunks(request)
        for key in keys:
            self.tier.read_ahead(key)
        return len(keys)

    def before_execute(self, scheduled: object) -> None:
        self._save()
        self.cache.drain_loads()  # the payloads are keys: nothing to write; their reads were charged
        stall = self.tier.take_stall()
        if stall:
            self.stall_s += stall
            self.advance(stall)

    def after_update(self, scheduled: object) -> None:
        self._save()

    def after_outputs(self) -> None:
        self._save()

    def _save(self) -> None:
        for save in self.cache.drain_saves():
            self.tier.put(save.key, self.tier.manifest.payload_bytes * b"\0")

    def on_reset(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        hits = self.cache.tier_stats
        return {
            "tier": self.tier.name,
            "tier_cost": self.tier.cost.name,
            "tier_capacity_tokens": self.tier.capacity_bytes,
            "tier_hit_tokens": hits.hit_tokens,
            "tier_loaded_chunks": hits.loaded_chunks,
            "tier_saved_chunks": hits.saved_chunks,
            "tier_dropped_saves": self.tier.dropped_writes,
            "tier_evicted_chunks": self.tier.store.stats.evicted,  # the store's (shared: every replica's puts)
            "tier_read_ahead_chunks": self.tier.read_ahead_chunks,
            "tier_probes": self.tier.probes,
            "tier_stall_s": self.stall_s,
        }


@dataclass(frozen=True)
class SimTierOptions:
    """A simulated tier: its size in tokens, chunk, write policy and cost."""

    capacity_tokens: int
    cost: TierCost
    chunk_tokens: int = 16
    write_policy: str = "write_through"


def tiered(
    kv: KVCacheManager,
    options: SimTierOptions,
    hash_algo: str,
    clock: Callable[[], float],
    advance,
    store: SimStore | None = None,
) -> tuple[TieredKVCache, SimTierCopier]:
    """`kv` behind the engine's tiered cache over a simulated tier (on `store` when it is shared with other
    replicas), and the step component that runs it."""
    tier = SimTier(options.capacity_tokens, options.chunk_tokens, hash_algo, options.cost, clock, store=store)
    cache = TieredKVCache(kv, tier, options.chunk_tokens, hash_algo, options.write_policy)
    return cache, SimTierCopier(cache, tier, advance)
