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

from prefixkv.choices import HASH_ALGOS, check

ROOT_KEY = hashlib.sha256(b"prefixkv/root").digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxhash": _xxh3_128}
assert tuple(HASH_FUNCTIONS) == HASH_ALGOS, "choices.HashAlgo names these functions"


def hash_function(algo: str) -> Callable[[bytes], bytes]:
    """The chain's hash function for prefix_caching_hash_algo (ValueError naming the choices otherwise): every
    cache and the tier check the option here."""
    check("prefix_caching_hash_algo", algo, HASH_ALGOS)
    return HASH_FUNCTIONS[algo]


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


def extend_block_keys(
    keys: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    hash_fn: Callable[[bytes], bytes],
    lora_id: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence = (),
) -> list[bytes]:
    """Append the keys of blocks len(keys) .. num_blocks - 1 to `keys` (a prefix of this prompt's chain, kept by
    the caller so growing prompts hash each block once) and return it."""
    parent = keys[-1] if keys else ROOT_KEY
    plain = lora_id is None and cache_salt is None and not mm_hashes
    for i in range(len(keys), num_blocks):
        extra = () if plain else block_extra_keys(i, block_size, lora_id, cache_salt, mm_hashes)
        parent = hash_block(hash_fn, parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        keys.append(parent)
    return keys


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256",
    lora_id: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence = (),
) -> list[bytes]:
    """Keys of every full block of token_ids (what the cache would store for this prompt)."""
    num_blocks = len(token_ids) // block_size
    return extend_block_keys(
        [], token_ids, block_size, num_blocks, HASH_FUNCTIONS[algo], lora_id, cache_salt, mm_hashes
    )


def external_block_hash(key: bytes) -> int:
    """A block key as KV events carry it: its first 8 bytes, big-endian, unsigned (routers index u64s; two
    different keys share one with odds of 2^-64 per pair)."""
    return int.from_bytes(key[:8], "big")


def prompt_block_hashes(
    token_ids: Sequence[int],
    page_size: int,
    algo: str = "sha256",
    lora_id: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence = (),
) -> list[int]:
    """The hashes KV events name for every full page of this prompt, with either prefix cache: what a router
    computes for an incoming prompt to look it up in its block index."""
    keys = hash_prompt_blocks(token_ids, page_size, algo, lora_id, cache_salt, mm_hashes)
    return [external_block_hash(k) for k in keys]
