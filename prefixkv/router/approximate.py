"""Approximate cache-aware routing (SGLang's router): guess each replica's cache from the prompts routed to it.

Per replica, a prefix tree of the prompts this router sent there, LRU-bounded, stands in for the replica's cache.
The tree is kept at block granularity: a node is a block's chain hash (the same key the caches use, salt and
adapter included), so a node stands for the whole prefix up to it and the tree is a map hash -> replicas holding
it. SGLang's tree is character-level; blocks lose at most a partial last block of a match, and the router then
predicts exactly what a cache of that block size could hit.

The rule, with SGLang's defaults: when the load is imbalanced (max - min > 64 requests and max > 1.5 x min),
the least-loaded replica; else the replica with the longest match if it covers more than 30% of the prompt;
else the replica with the smallest tree (the one with the most room, so new prefixes spread out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixkv.router.block_index import leading_matches
from prefixkv.router.policy import RoutingPolicy, least_loaded, load_key
from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest


class RoutedPrefixTrees:
    """The prefixes routed to each replica, as block hashes with one LRU order per replica.

    A prompt's blocks are touched leaf first, root last, so a block is never older than the blocks that continue
    it: evicting from the LRU end removes leaves before their parents and never strands a reachable suffix."""

    def __init__(self, block_size: int, max_tree_tokens: int | None) -> None:
        self.block_size = block_size
        self.max_tree_blocks = None if max_tree_tokens is None else max(1, max_tree_tokens // block_size)
        self._lru: dict[str, OrderedDict[int, None]] = {}  # replica -> its block hashes, least recent first
        self._holders: dict[int, set[str]] = {}  # block hash -> replicas whose tree has it
        self.evicted_blocks = 0

    def tree_tokens(self, replica_id: str) -> int:
        return len(self._lru.get(replica_id, ())) * self.block_size

    def insert(self, replica_id: str, hashes: Sequence[int]) -> None:
        lru = self._lru.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(replica_id)
        if self.max_tree_blocks is not None:
            while len(lru) > self.max_tree_blocks:
                h, _ = lru.popitem(last=False)
                self._drop_holder(h, replica_id)
                self.evicted_blocks += 1

    def matched_blocks(self, hashes: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of `hashes` its tree holds."""
        return leading_matches(self._holders, hashes, replica_ids)

    def remove(self, replica_id: str) -> None:
        for h in self._lru.pop(replica_id, {}):
            self._drop_holder(h, replica_id)

    def _drop_holder(self, h: int, replica_id: str) -> None:
        holders = self._holders[h]
        holders.discard(replica_id)
        if not holders:
            del self._holders[h]


class ApproximateRouting(RoutingPolicy):
    name = "approximate"

    def __init__(
        self,
        block_size: int = 16,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        match_threshold: float = 0.3,
        max_tree_tokens: int | None = 2**24,
        hash_algo: str = "sha256",
    ) -> None:
        self.trees = RoutedPrefixTrees(block_size, max_tree_tokens)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.match_threshold = match_threshold
        self.hash_algo = hash_algo

    def imbalanced(self, replicas: Sequence[ReplicaState]) -> bool:
        loads = [r.load for r in replicas]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        if self.imbalanced(replicas):
            return least_loaded(replicas).replica_id
        hashes = request.block_hashes(self.trees.block_size, self.hash_algo)
        matched = self.trees.matched_blocks(hashes, [r.replica_id for r in replicas])
        best = min(replicas, key=lambda r: (-matched[r.replica_id], *load_key(r)))
        matched_tokens = matched[best.replica_id] * self.trees.block_size
        if request.num_tokens and matched_tokens / request.num_tokens > self.match_threshold:
            return best.replica_id
        return min(replicas, key=lambda r: (self.trees.tree_tokens(r.replica_id), *load_key(r))).replica_id

    def on_routed(self, request: RouteRequest, replica_id: str) -> None:
        self.trees.insert(replica_id, request.block_hashes(self.trees.block_size, self.hash_algo))

    def on_replica_removed(self, replica_id: str) -> None:
        self.trees.remove(replica_id)

    def held_prefix_tokens(self, request: RouteRequest, replica_ids: Sequence[str]) -> dict[str, int]:
        """What each replica's tree says it holds of the prompt (a guess: the prompts routed there)."""
        size = self.trees.block_size
        matched = self.trees.matched_blocks(request.block_hashes(size, self.hash_algo), replica_ids)
        return {rid: blocks * size for rid, blocks in matched.items()}
