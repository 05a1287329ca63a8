"""Block keys of the hash-chain prefix cache.

key(block i) = H(key(block i-1), token ids of block i, extra keys). Block 0's parent is a fixed seed, so one key
stands for the whole prefix up to its block. The serialisation is canonical (little-endian uint32 token ids,
length-prefixed UTF-8 extra keys), so two processes compute the same keys for the same prompt: routers and logs
rely on that.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

ROOT_KEY = hashlib.sha256(b"prefixkv/root").digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxhash": _xxh3_128}


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    a = array("I", token_ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _extra_bytes(extra_keys: Sequence[str]) -> bytes:
    out = bytearray()
    for key in extra_keys:
        raw = key.encode()
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def block_extra_keys(
    block_index: int, block_size: int, lora_id: str | None, cache_salt: str | None, mm_hashes: Sequence = ()
) -> tuple[str, ...]:
    """Extra keys of one block: adapter id (every block), overlapping multimodal input hashes, salt (block 0)."""
    keys: list[str] = []
    if lora_id is not None:
        keys.append("lora:" + str(lora_id))
    start, end = block_index * block_size, (block_index + 1) * block_size
    for mm in mm_hashes:
        if mm.offset < end and mm.offset + mm.length > start:
            keys.append("mm:" + mm.hash)
    if block_index == 0 and cache_salt is not None:
        keys.append("salt:" + cache_salt)
    return tuple(keys)


def hash_block(
    hash_fn: Callable[[bytes], bytes], parent_key: bytes, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> bytes:
    tokens = _token_bytes(token_ids)
    extra = _extra_bytes(extra_keys) if extra_keys else b""  # most blocks have none: skip the work
    return hash_fn(parent_key + struct.pack("<I", len(token_ids)) + tokens + extra)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    lora_id: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence = (),
) -> list[bytes]:
    """Keys of every full block of token_ids (what the cache would store for this prompt)."""
    fn = HASH_FUNCTIONS[algo]
    keys: list[bytes] = []
    parent = ROOT_KEY
    for i in range(len(token_ids) // block_size):
        extra = block_extra_keys(i, block_size, lora_id, cache_salt, mm_hashes)
        parent = hash_block(fn, parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        keys.append(parent)
    return keys
