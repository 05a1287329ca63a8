"""Precise cache-aware routing: score each replica on what its cache really holds (the KV events' index).

The cost, after NVIDIA Dynamo's KV router, is in blocks of work a replica would have ahead of this request:
    cost = prefill_weight * blocks to prefill + decode_weight * blocks to decode
where blocks to prefill are this prompt's blocks the replica misses plus the prompt tokens its queue still has
to compute, and blocks to decode are the blocks its running requests hold. The lowest cost wins; among equal
costs the less loaded, then the replica caching the fewest blocks (so on an idle fleet new prefixes spread out
instead of piling onto the first replica). A big prefix hit wins unless the replica is that much busier; the
weights trade hit rate against load.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixkv.router.block_index import BlockIndex
from prefixkv.router.policy import RoutingPolicy, load_key
from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest


class PreciseRouting(RoutingPolicy):
    name = "precise"

    def __init__(
        self,
        block_size: int = 16,
        prefill_weight: float = 1.0,
        decode_weight: float = 1.0,
        hash_algo: str = "sha256",
    ) -> None:
        self.index = BlockIndex()
        self.block_size = block_size  # the replicas' page size: the events' hashes are per page
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.hash_algo = hash_algo

    def costs(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> dict[str, float]:
        hashes = request.block_hashes(self.block_size, self.hash_algo)
        matched = self.index.matched_blocks(hashes, [r.replica_id for r in replicas])
        prompt_blocks = -(-request.num_tokens // self.block_size)
        costs = {}
        for r in replicas:
            prefill = prompt_blocks - matched[r.replica_id] + r.pending_prefill_tokens / self.block_size
            costs[r.replica_id] = self.prefill_weight * prefill + self.decode_weight * r.active_blocks
        return costs

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        costs = self.costs(request, replicas)
        cached = self.index.num_blocks
        return min(replicas, key=lambda r: (costs[r.replica_id], r.load, cached(r.replica_id), *load_key(r))).replica_id

    def on_kv_events(self, replica_id: str, events: Sequence[object]) -> None:
        self.index.apply(replica_id, events)

    def on_replica_removed(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
