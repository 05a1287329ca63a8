"""The free blocks of the hash cache as an intrusive doubly-linked list: O(1) pop-head, append, remove-middle.

The order is the eviction order: the head is the least recently freed block. A prefix hit on a free cached block
takes it out of the middle in O(1) through its own prev/next pointers, with no Python list scan.
"""

from __future__ import annotations

from collections.abc import Iterator


class Block:
    """One page of the pool, created once at start. ref_cnt > 0 means some request uses it."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "cache_salt",
        "lora_id",
        "prev_free",
        "next_free",
        "parent_hash",
        "position",
        "hits",
        "last_access",
        "release_age",
        "heap_seq",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.cache_salt: str | None = None  # the namespace (tenant) of the cached KV, for a per-tenant reset
        self.lora_id: str | None = None  # and its adapter (the cache summary's namespace rows)
        self.prev_free: Block | None = None
        self.next_free: Block | None = None
        # set while cached, for eviction policies other than LRU (they need the chain's shape and the block's use)
        self.parent_hash: bytes | None = None  # the key of the block before it in its chain (ROOT_KEY for the first)
        self.position = 0  # tokens before it in its sequence
        self.hits = 0  # admissions that took it as part of their cache hit
        self.last_access = 0  # logical time of the release that freed it (the cache's release clock)
        self.release_age = 0.0  # the eviction policy's age at that release (what its priority starts from)
        self.heap_seq = 0  # its current entry in the eviction heap (older entries are stale)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)  # sentinels: no None checks on the hot path
        self._tail = Block(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        """Most recently used end: evicted last."""
        last = self._tail.prev_free
        assert last is not None  # the sentinels are always linked
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: Block) -> None:
        """Reused first (blocks holding nothing worth keeping)."""
        first = self._head.next_free
        assert first is not None
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free += 1

    def first(self) -> Block | None:
        block = self._head.next_free
        return None if block is self._tail else block

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free
