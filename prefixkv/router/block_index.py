"""Which replica holds which block, rebuilt from the KV events the replicas publish (vLLM's event schema).

The index is the router's copy of every replica's prefix cache, at block granularity: BlockStored adds the
replica to each hash's holders, BlockRemoved takes it away, AllBlocksCleared empties the replica, and a replica
that leaves drops out entirely. Events are dispatched on their class name, so the engine's own event objects
and a decoder's (msgspec structs, or anything with the same fields) are applied alike. Only the device tier
counts (medium None or "GPU"): a block offloaded elsewhere is not a hit the replica can serve at full speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

_DEVICE_MEDIUMS = (None, "GPU")


def leading_matches(
    holders: Mapping[int, set[str]], hashes: Sequence[int], replica_ids: Sequence[str]
) -> dict[str, int]:
    """Per replica, how many leading blocks of `hashes` the replica holds, given block hash -> holders."""
    matched = dict.fromkeys(replica_ids, 0)
    alive = set(replica_ids)
    for i, h in enumerate(hashes):
        alive &= holders.get(h, set())
        if not alive:
            break
        for r in alive:
            matched[r] = i + 1
    return matched


class BlockIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> replicas holding it
        self._blocks: dict[str, set[int]] = {}  # replica -> block hashes it holds

    def apply(self, replica_id: str, events: Iterable[object]) -> None:
        """Apply one replica's events, in the order it published them."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                if getattr(event, "medium", None) in _DEVICE_MEDIUMS:
                    self._store(replica_id, event.block_hashes)  # type: ignore[attr-defined]
            elif kind == "BlockRemoved":
                if getattr(event, "medium", None) in _DEVICE_MEDIUMS:
                    self._remove(replica_id, event.block_hashes)  # type: ignore[attr-defined]
            elif kind == "AllBlocksCleared":
                self.remove_replica(replica_id)
            else:
                raise ValueError(f"unknown KV event {kind!r} from replica {replica_id!r}")

    def _store(self, replica_id: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.setdefault(replica_id, set())
        for h in hashes:
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(replica_id)

    def _remove(self, replica_id: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.get(replica_id)
        if mine is None:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                holders = self._holders[h]
                holders.discard(replica_id)
                if not holders:
                    del self._holders[h]

    def remove_replica(self, replica_id: str) -> None:
        """Forget every block of `replica_id` (its cache was cleared, or it is gone)."""
        self._remove(replica_id, list(self._blocks.get(replica_id, ())))
        self._blocks.pop(replica_id, None)

    def blocks(self, replica_id: str) -> set[int]:
        """The block hashes the index believes `replica_id` holds (a copy)."""
        return set(self._blocks.get(replica_id, ()))

    def holds(self, replica_id: str, block_hash: int) -> bool:
        return replica_id in self._holders.get(block_hash, ())

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))

    def matched_blocks(self, hashes: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of `hashes` it holds (a lookup stops at the first miss)."""
        return leading_matches(self._holders, hashes, replica_ids)
