"""What the shared KV store holds (the engine's `--kv-remote` tier), rebuilt from KV events with medium "REMOTE".

One store serves every replica: a chunk any replica stored there is loaded by any other instead of recomputed.
So the store's contents are one set for the whole fleet, not a replica's: a BlockStored with medium "REMOTE"
means the store holds those chunks for everyone, a BlockRemoved with it that it dropped them, whoever publishes
them (the replica whose writer stored the chunk, or a watcher of the store's evictions). Its hashes are chain
hashes as KV events carry them (hashing.external_block_hash) at the events' block_size, one size for the store:
an engine names the pages of each chunk it stored (block_size its page size: kvcache/offload/tiered_cache.py),
the simulator its chunks (block_size the chunk size: sim/shared_tier.py). The device-tier index (block_index.py)
ignores these events, and this index ignores every other medium, so a fleet without a store routes as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixkv.router.request import RouteRequest

MEDIUM_REMOTE = "REMOTE"


class SharedStoreIndex:
    def __init__(self) -> None:
        self._chunks: set[int] = set()  # chunk hashes the store holds
        self.chunk_tokens: int | None = None  # the store's chunk size, from the first event that names it

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def present(self) -> bool:
        """Whether a shared store has published at all (the fleet has one, even while it holds nothing)."""
        return self.chunk_tokens is not None

    def apply(self, events: Iterable[object]) -> None:
        """Apply the events of medium "REMOTE" among `events` (any publisher's); the rest are not the store's."""
        for event in events:
            if getattr(event, "medium", None) != MEDIUM_REMOTE:
                continue
            kind = type(event).__name__  # by name, as BlockIndex.apply dispatches
            if kind == "BlockStored":
                size = getattr(event, "block_size")  # noqa: B009 - any decoder's event class
                if self.chunk_tokens is not None and size != self.chunk_tokens:
                    raise ValueError(f"a REMOTE event of {size}-token chunks; the store's are {self.chunk_tokens}")
                self.chunk_tokens = size
                self._chunks.update(getattr(event, "block_hashes"))  # noqa: B009
            elif kind == "BlockRemoved":
                self._chunks.difference_update(getattr(event, "block_hashes"))  # noqa: B009

    def holds(self, chunk_hash: int) -> bool:
        return chunk_hash in self._chunks

    def held_tokens(self, request: RouteRequest, hash_algo: str) -> int:
        """The leading prompt tokens whose chunks the store holds (a lookup stops at the first it lacks)."""
        if not self._chunks or self.chunk_tokens is None:
            return 0
        held = 0
        for h in request.block_hashes(self.chunk_tokens, hash_algo):
            if h not in self._chunks:
                break
            held += 1
        return held * self.chunk_tokens
