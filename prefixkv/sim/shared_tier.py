"""The shared KV tier in a simulation: one store behind every replica's pool, as `--kv-remote` puts one Redis behind
every engine (kvcache/offload/remote_tier.py), and the KV events that tell a router what the store holds.

Each replica runs the engine's own tiered cache over a SimTier of its own (sim/tier.py): its own read and write
channels at the store's rates (each replica is one client of the store, as the rates were measured) and its own
round trips, all on one SharedStore. A chunk any replica wrote is found by every other once its write completes,
a chunk another replica already stored is not written again, and the store's LRU runs over every replica's reads
and writes within one capacity. Not modelled: the store server's own limits when many replicas read at once (the
rates were measured with one client) and a network between hosts (the store ran on the same machine).

What a router learns: each chunk stored is a BlockStored of medium "REMOTE" (router/store_index.py), due when its
write completes, and each chunk the store evicts a BlockRemoved of that medium, due at once; the replica loop
hands the router those due by an arrival before routing it (sim/replicas.py). In a deployment the first would
come from the replicas' writers and the second from the store's eviction notifications. The simulated store holds
keys, not tokens: its events carry the chunk hashes and size, with no token ids (a router reads only the hashes).
"""

from __future__ import annotations

import heapq

from prefixkv.kvcache.events import BlockRemoved, BlockStored
from prefixkv.kvcache.hashing import external_block_hash
from prefixkv.router.store_index import MEDIUM_REMOTE
from prefixkv.sim.cost_model import StepCostModel
from prefixkv.sim.tier import REDIS_PRESETS_BY_CHUNK, SimStore, TierCost

SHARED_STORE_PUBLISHER = "shared-store"  # the id the store's event stream is handed to the router under


class SharedStore(SimStore):
    """A SimStore that every replica's SimTier shares, publishing what it stores and evicts (when `publish`)."""

    def __init__(self, capacity_tokens: int, chunk_tokens: int, publish: bool = False) -> None:
        super().__init__(capacity_tokens, chunk_tokens)
        self.publish = publish
        self._due: list[tuple[float, int, bool, bytes]] = []  # (when, order, stored?, key): a min-heap
        self._order = 0

    def on_stored(self, key: bytes, done: float) -> None:
        self._push(done, True, key)

    def on_evicted(self, key: bytes, at: float) -> None:
        self._push(at, False, key)

    def _push(self, when: float, stored: bool, key: bytes) -> None:
        if self.publish:
            heapq.heappush(self._due, (when, self._order, stored, key))
            self._order += 1

    def drain_events(self, now: float) -> list[BlockStored | BlockRemoved]:
        """The events due by `now`, in time order. A write whose chunk was evicted before it was done (or stored
        again since) announces nothing: the store never held it readable, or its later write will say so."""
        events: list[BlockStored | BlockRemoved] = []
        while self._due and self._due[0][0] <= now:
            when, _, stored, key = heapq.heappop(self._due)
            h = external_block_hash(key)
            if not stored:
                events.append(BlockRemoved([h], MEDIUM_REMOTE, 0))
            elif self.written_at(key) == when:
                events.append(BlockStored([h], None, [], self.chunk_tokens, medium=MEDIUM_REMOTE, group_idx=0))
        return events


def default_shared_tier_cost(chunk_tokens: int) -> TierCost:
    """The store measured on this machine, at the measured chunk size nearest to `chunk_tokens`."""
    nearest = min(REDIS_PRESETS_BY_CHUNK, key=lambda size: abs(size - chunk_tokens))
    return REDIS_PRESETS_BY_CHUNK[nearest]


def remote_block_weight(step_cost: StepCostModel, tier_cost: TierCost, chunk_tokens: int) -> float:
    """What a block loaded from the store costs next to one computed, for the precise router: a chunk's read and
    its EXISTS against the cost model's time for its tokens (per-token part only: attention's part, which grows
    with the position, is left out, so the figure errs toward loading being dearer)."""
    load_s = tier_cost.read_s(chunk_tokens) + tier_cost.op_latency_s
    return load_s / (chunk_tokens * step_cost.per_token_s)
