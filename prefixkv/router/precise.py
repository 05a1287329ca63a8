"""Precise cache-aware routing: score each replica on what its cache really holds (the KV events' index).

The cost, after NVIDIA Dynamo's KV router, is in blocks of work a replica would have ahead of this request:
    cost = prefill_weight * blocks to prefill + decode_weight * blocks to decode
where blocks to prefill are this prompt's blocks the replica misses plus, weighted by queue_weight, the prompt
tokens its queue still has to compute (in blocks), and blocks to decode are the blocks its running requests hold.
The lowest cost wins; among equal costs the less loaded, then the replica caching the fewest blocks (so on an
idle fleet new prefixes spread out instead of piling onto the first replica). As in SGLang's rule, a fleet whose
load is clearly imbalanced (max - min > 64 requests and max > 1.5 x min) goes to the least loaded first.

The default weights (misses 1, queued prefill 0.02, decode 0.001) are not Dynamo's (decode 1, queue 1): on the
Mooncake conversation trace those let load outweigh hits so far that the hit rate fell 9 points below the
approximate router's, because every miss also duplicates a prefix and crowds the replicas' caches. They come from
a sweep in the simulator on one slice of that trace (its first 3,000 requests: queue_weight 0-1 with decode 0,
then decode_weight 0.001-0.1, then queue_weight refined; the lowest TTFT p90 over 4 and 8 replicas, 16x-128x
load, 5% and 10% pools) and are reported on a disjoint later slice (trace seconds 1800-2637), never tuned on:
docs/benchmarks/routing/README.md and tune_precise_weights.py there. With no load term at all, every request
sharing a hot prefix herds onto one replica. Decode 0.001 is a mild pull toward the replica with less to decode:
a running request there holds ~100 blocks on that trace (prompt plus output, 16-token pages), about a tenth of one
missed block.

With a shared KV store (the engine's `--kv-remote` tier), a replica that lacks a prefix in its pool loads from
the store what the store holds after its own hit, instead of computing it. The store's contents come from KV
events with medium "REMOTE" (store_index.py), and such a block costs remote_block_weight of a missed block: what
loading a block from the store costs next to computing it (0.1 by default: on this 2-core AMD EPYC, a 16-token
SmolLM2-135M chunk reads from a local Redis in 0.78 ms + a 0.107 ms EXISTS, against 16 x 0.62 ms to compute it;
the simulator derives it from its cost models). The replica holding a prefix then leads the others by that
fraction of it only, not by all of it, so the same load terms move a prefix's followers to a less busy replica
long before they would without the store, and the hit stays a hit. No REMOTE event, no store: the costs are
exactly those above.

Events only announce what a replica has computed. A prompt routed a moment ago is still queued or prefilling, and
a second request with its prefix must follow it, or two replicas compute (and cache) the same prefix. So the
router also counts the blocks of the prompts it routed as held where it sent them, until that replica's events
store them, the request finishes without storing them (rejected, aborted), or a bounded number of newer routings
pushes them out (a request whose end the router never heard of).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixkv.router.block_index import BlockIndex
from prefixkv.router.policy import RoutingPolicy, least_loaded, load_key
from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest
from prefixkv.router.store_index import MEDIUM_REMOTE, SharedStoreIndex


class PreciseRouting(RoutingPolicy):
    name = "precise"

    def __init__(
        self,
        block_size: int = 16,
        prefill_weight: float = 1.0,
        decode_weight: float = 0.001,
        queue_weight: float = 0.02,
        max_in_flight_blocks: int = 1_000_000,
        balance_abs_threshold: int | None = 64,
        balance_rel_threshold: float = 1.5,
        hash_algo: str = "sha256",
        remote_block_weight: float = 0.1,
    ) -> None:
        self.index = BlockIndex()
        self.store = SharedStoreIndex()  # empty unless a shared store publishes (medium "REMOTE")
        self.block_size = block_size  # the replicas' page size: the events' hashes are per page
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.queue_weight = queue_weight
        self.hash_algo = hash_algo
        self.max_in_flight_blocks = max_in_flight_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.remote_block_weight = remote_block_weight
        # blocks of routed prompts no event has confirmed yet: (replica, hash), oldest first
        self._in_flight: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._in_flight_holders: dict[int, set[str]] = {}

    def matched_blocks(self, request: RouteRequest, replica_ids: Sequence[str]) -> dict[str, int]:
        """Per replica, the leading blocks of the prompt it holds or is computing for a request routed there."""
        hashes = request.block_hashes(self.block_size, self.hash_algo)
        matched = self.index.matched_blocks(hashes, replica_ids)
        if not self._in_flight_holders:
            return matched
        for rid in replica_ids:
            n = matched[rid]
            while n < len(hashes) and self._held_or_coming(rid, hashes[n]):
                n += 1
            matched[rid] = n
        return matched

    def held_prefix_tokens(self, request: RouteRequest, replica_ids: Sequence[str]) -> dict[str, int]:
        """What each replica holds of the prompt by its KV events, or is computing for a prompt routed there."""
        return {rid: blocks * self.block_size for rid, blocks in self.matched_blocks(request, replica_ids).items()}

    @property
    def num_in_flight_blocks(self) -> int:
        """Blocks of routed prompts the router still expects an event for."""
        return len(self._in_flight)

    def _held_or_coming(self, replica_id: str, block_hash: int) -> bool:
        return self.index.holds(replica_id, block_hash) or replica_id in self._in_flight_holders.get(block_hash, ())

    def costs(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> dict[str, float]:
        matched = self.matched_blocks(request, [r.replica_id for r in replicas])
        prompt_blocks = -(-request.num_tokens // self.block_size)
        stored = self.store.held_tokens(request, self.hash_algo) // self.block_size  # loadable by every replica
        costs = {}
        for r in replicas:
            queued = r.pending_prefill_tokens / self.block_size
            own = matched[r.replica_id]
            loaded = max(0, stored - own)  # the store serves what the replica's own hit stops short of
            prefill = prompt_blocks - own - loaded + self.remote_block_weight * loaded + self.queue_weight * queued
            costs[r.replica_id] = self.prefill_weight * prefill + self.decode_weight * r.active_blocks
        return costs

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        if self.balance_abs_threshold is not None:
            high, low = max(r.load for r in replicas), min(r.load for r in replicas)
            if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
                return least_loaded(replicas).replica_id
        costs = self.costs(request, replicas)
        cached = self.index.num_blocks
        return min(replicas, key=lambda r: (costs[r.replica_id], r.load, cached(r.replica_id), *load_key(r))).replica_id

    def on_routed(self, request: RouteRequest, replica_id: str) -> None:
        for h in request.block_hashes(self.block_size, self.hash_algo):
            if not self.index.holds(replica_id, h):
                self._add_in_flight(replica_id, h)
        while len(self._in_flight) > self.max_in_flight_blocks:
            (rid, h), _ = self._in_flight.popitem(last=False)
            self._drop_in_flight_holder(rid, h)

    def on_finished(self, request: RouteRequest, replica_id: str) -> None:
        """Blocks of a finished request that no event stored never will be (rejected, aborted): stop expecting them."""
        if not self._in_flight:
            return
        for h in request.block_hashes(self.block_size, self.hash_algo):
            self._confirm(replica_id, h)

    def on_kv_events(self, replica_id: str, events: Sequence[object]) -> None:
        self.index.apply(replica_id, events)
        self.store.apply(events)
        if not self._in_flight:
            return
        for event in events:
            if type(event).__name__ == "BlockStored" and getattr(event, "medium", None) != MEDIUM_REMOTE:
                for h in getattr(event, "block_hashes"):  # noqa: B009 - any decoder's event class
                    self._confirm(replica_id, h)

    def on_replica_removed(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        for rid, h in [key for key in self._in_flight if key[0] == replica_id]:
            del self._in_flight[rid, h]
            self._drop_in_flight_holder(rid, h)

    def _confirm(self, replica_id: str, h: int) -> None:
        """The block is stored at the replica (the index has it now) or never will be: stop expecting it."""
        if (replica_id, h) in self._in_flight:
            del self._in_flight[replica_id, h]
            self._drop_in_flight_holder(replica_id, h)

    def _add_in_flight(self, replica_id: str, h: int) -> None:
        key = (replica_id, h)
        if key in self._in_flight:
            self._in_flight.move_to_end(key)
            return
        self._in_flight[key] = None
        self._in_flight_holders.setdefault(h, set()).add(replica_id)

    def _drop_in_flight_holder(self, replica_id: str, h: int) -> None:
        holders = self._in_flight_holders.get(h)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._in_flight_holders[h]
