"""The two msgpack layouts of an event batch, written with msgspec as vLLM writes them.

Every message is three ZeroMQ frames: [topic (UTF-8), sequence number (8 bytes, big-endian), payload]. The
payload is one EventBatch(ts, events, data_parallel_rank):

format "vllm" (the default; vLLM's releases since events became maps, vllm-project/vllm#42892, e.g. v0.26 as
  kthena#1535 captured it: [ts, [{"type": "BlockStored", ...}], 0]): the batch is an array
    [ts: float, events: array, data_parallel_rank: int]
  and each event a map tagged with its class name under "type", fields in declaration order, fields with a
  default left out while they hold it:
    {"type": "BlockStored", "block_hashes": [int...], "parent_block_hash": int|nil, "token_ids": [int...],
     "block_size": int, "lora_id": int|nil, "medium": str|nil, "lora_name": str|nil,
     "extra_keys"?: [array|nil...], "group_idx"?: int, "kv_cache_spec_kind"?: str,
     "kv_cache_spec_sliding_window"?: int}
    {"type": "BlockRemoved", "block_hashes": [int...], "medium": str|nil, "group_idx"?: int}
    {"type": "AllBlocksCleared"}
format "array" (older vLLM releases, what Ray Serve's KV event manager and Dynamo decode): the same batch
  array, and each event an array whose first element is the class name:
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]
  The first releases declared fewer fields (no medium; BlockRemoved only its hashes; no data_parallel_rank):
  their array-like msgspec decoders ignore the trailing fields, so they read this layout too.
Not written: a batch encoded as a map ({"ts", "events", "data_parallel_rank"}), which a later vLLM main declares.
"""

from __future__ import annotations

from typing import Any

import msgspec

from prefixkv.choices import KV_EVENTS_FORMATS
from prefixkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

FORMATS = KV_EVENTS_FORMATS


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# -- format "vllm": events as tagged maps ----------------------------------------------------------------------
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(_Batch):
    events: list[_MapStored | _MapRemoved | _MapCleared]


# -- format "array": events as tagged arrays -------------------------------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(_Batch):
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]


def _to_wire(event: KVCacheEvent, fmt: str) -> msgspec.Struct:
    if isinstance(event, BlockStored):
        if fmt == "array":
            return _ArrayStored(
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
            )
        return _MapStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
        )
    if isinstance(event, BlockRemoved):
        if fmt == "array":
            return _ArrayRemoved(event.block_hashes, event.medium)
        return _MapRemoved(event.block_hashes, event.medium, event.group_idx)
    return _ArrayCleared() if fmt == "array" else _MapCleared()


def _from_wire(event: msgspec.Struct) -> KVCacheEvent:
    if isinstance(event, _MapStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            [tuple(k) if k is not None else None for k in event.extra_keys] if event.extra_keys is not None else None,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
        )
    if isinstance(event, _ArrayStored):
        return BlockStored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.lora_id, event.medium
        )
    if isinstance(event, _MapRemoved):
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx)
    if isinstance(event, _ArrayRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"kv_events_format must be one of {FORMATS}, got {fmt!r}")
    return fmt


class BatchEncoder:
    """Encodes event batches in one format (one msgspec encoder, reused)."""

    def __init__(self, fmt: str = "vllm") -> None:
        self.format = check_format(fmt)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[KVCacheEvent], data_parallel_rank: int | None = 0) -> bytes:
        wire = [_to_wire(e, self.format) for e in events]
        return self._encoder.encode(_Batch(ts, wire, data_parallel_rank))


class BatchDecoder:
    """Decodes payloads of one format back into (ts, events, data_parallel_rank), events as kvcache/events.py's
    dataclasses (for subscribers such as the router)."""

    def __init__(self, fmt: str = "vllm") -> None:
        batch_type = _ArrayBatch if check_format(fmt) == "array" else _MapBatch
        self._decoder = msgspec.msgpack.Decoder(batch_type)

    def decode(self, payload: bytes) -> tuple[float, list[KVCacheEvent], int | None]:
        batch = self._decoder.decode(payload)
        return batch.ts, [_from_wire(e) for e in batch.events], batch.data_parallel_rank
