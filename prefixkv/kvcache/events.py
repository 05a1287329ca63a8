"""What a prefix cache tells the outside world about its contents: vLLM's KV cache events, as plain dataclasses.

A router that wants to send a prompt where its prefix is cached keeps an index of which replica holds which block.
It learns that from these events: a block became findable (BlockStored), blocks were evicted (BlockRemoved), or
the whole cache was dropped (AllBlocksCleared). The field names and their order are vLLM's
(vllm/distributed/kv_events.py), so the wire encoders (prefixkv/kv_events/) can lay them out exactly as vLLM does
and existing subscribers decode them unchanged. This module knows nothing of the wire.

What prefixkv fills in:
- block_hashes: a page's chain hash (hashing.py) as an int, the first 8 bytes of the digest read big-endian
  (see hashing.external_block_hash). Both caches emit the same hash for the same page of the same prompt.
- parent_block_hash: the hash of the page before the first of block_hashes; None for a prompt's first page.
- token_ids: the token ids of every page in block_hashes, concatenated (len == len(block_hashes) * block_size).
- block_size: the page size in tokens.
- lora_id: always None (vLLM deprecated this int id; prefixkv's adapter ids are names, sent as lora_name).
- medium: "GPU" for the pool (whatever the device: subscribers filter on it); a chunk stored in a tier behind the
  pool is a BlockStored of its pages with the tier's medium: "CPU" (host RAM), "DISK", "REMOTE" (the store
  replicas share), TIER_MEDIUMS.
- lora_name: the request's adapter id (None without one).
- extra_keys: per block, the extra keys its hash took (hashing.block_extra_keys: "lora:<id>", "mm:<hash>",
  "salt:<salt>" on page 0) as a tuple, or None for a block with none (vLLM sends [None, ...] likewise).
- group_idx: 0 and kv_cache_spec_kind: "full_attention" (one KV cache group of full attention, as vLLM reports a
  plain decoder); kv_cache_spec_sliding_window: None. BlockRemoved carries group_idx 0 too.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixkv.kvcache.hashing import block_extra_keys, external_block_hash
from prefixkv.request import Request

MEDIUM_GPU = "GPU"
TIER_MEDIUMS = {"host": "CPU", "disk": "DISK", "remote": "REMOTE"}  # a KVTier's name -> its medium in events


def tier_medium(tier_name: str) -> str:
    """The medium KV events name a tier by (its name upper-cased for a tier not in TIER_MEDIUMS)."""
    return TIER_MEDIUMS.get(tier_name, tier_name.upper())


FULL_ATTENTION = "full_attention"


@dataclass(slots=True)
class BlockStored:
    """Consecutive pages of one prompt became findable, each one's parent the page before it."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """These pages were evicted: a lookup will not find them any more."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The cache holds nothing any more (a full reset that left no page cached)."""


def block_stored(request: Request, keys: list[bytes], first: int, end: int, page_size: int) -> BlockStored:
    """BlockStored for blocks first .. end - 1 of the request, whose chain keys are `keys` (both caches)."""
    extra: list[tuple | None] = [None] * (end - first)
    if request.lora_id is not None or request.cache_salt is not None or request.mm_hashes:
        extra = [
            block_extra_keys(i, page_size, request.lora_id, request.cache_salt, request.mm_hashes) or None
            for i in range(first, end)
        ]
    return BlockStored(
        block_hashes=[external_block_hash(keys[i]) for i in range(first, end)],
        parent_block_hash=external_block_hash(keys[first - 1]) if first else None,
        token_ids=list(request.token_ids[first * page_size : end * page_size]),
        block_size=page_size,
        lora_name=request.lora_id,
        extra_keys=extra,
        group_idx=0,
        kv_cache_spec_kind=FULL_ATTENTION,
    )


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def block_removed(block_hashes: list[int]) -> BlockRemoved:
    """BlockRemoved as both caches send it (group 0, the one pool)."""
    return BlockRemoved(block_hashes, MEDIUM_GPU, 0)


def apply_events(blocks: set[int], events: list[KVCacheEvent]) -> set[int]:
    """A subscriber's view of one replica's pool: the set of cached block hashes after `events` (changed in place;
    a tier's events, medium other than "GPU", are not the pool's)."""
    for event in events:
        if isinstance(event, (BlockStored, BlockRemoved)) and event.medium not in (None, MEDIUM_GPU):
            continue
        if isinstance(event, BlockStored):
            blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            blocks.difference_update(event.block_hashes)
        else:
            blocks.clear()
    return blocks
