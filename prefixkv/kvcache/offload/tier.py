"""What a second KV tier (host RAM, a directory on disk) offers the tiered cache: opaque payloads by chain key.

A tier never sees tensors or requests. Its keys are block-hash-chain keys computed over `chunk_tokens`-token
chunks (hashing.py: a key names the whole prefix up to its chunk, with the cache salt and adapter folded in, so
one tenant's key can never name another's KV). Its payloads are the chunk's K and V as bytes, in the layout the
manifest names. A tier may drop any entry at any time (capacity, corruption): a miss only costs a recompute, so
`get` returns None rather than raising for anything wrong with one entry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

LAYOUT_VERSION = 1  # bump when the payload layout below changes: old directories are then refused


@dataclass(frozen=True, slots=True)
class TierManifest:
    """Everything that must match for a stored payload to be the right KV for a key. A disk tier writes it into
    its directory and refuses (or ignores, as configured) a directory whose manifest differs."""

    model_digest: str  # xxh3-128 hex over the model's weights as loaded (prefixkv.model.loader)
    dtype: str  # KV dtype, e.g. "bfloat16"
    chunk_tokens: int  # tokens per entry (a multiple of the pool's page size)
    bytes_per_token: int  # K and V of one token over all layers
    hash_algo: str  # the chain's hash function ("sha256" | "xxhash")
    device: str = "cpu"  # device type the KV is computed on: other kernels give other bits than a recompute here
    # the kernels that compute it (ModelRunner.kernel_report's matmul and attention paths): an AMX machine's KV is
    # not bit for bit an AVX-512 one's, so a directory carried between them is refused like another model's
    kernels: str = ""
    layout: str = "layers,kv,kv_heads,tokens,head_dim"  # payload tensor order, C-contiguous
    layout_version: int = LAYOUT_VERSION

    @property
    def payload_bytes(self) -> int:
        return self.chunk_tokens * self.bytes_per_token

    def to_dict(self) -> dict:
        return asdict(self)

    def differences(self, other: TierManifest) -> list[str]:
        """'field: ours != theirs' for every field that differs (empty when the two match)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass(slots=True)
class TierStats:
    """Counters a tier keeps about itself (exported on /metrics and in bench JSON)."""

    entries: int = 0
    bytes: int = 0  # payload bytes held now
    hits: int = 0  # get() that returned a payload
    misses: int = 0  # get() of an absent key
    corrupt: int = 0  # entries found damaged (bad checksum, truncated, wrong size) and dropped
    evicted: int = 0  # entries dropped for capacity
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


class KVTier(Protocol):
    """A store of chunk payloads by chain key. Thread-safe: the engine writes from a background thread."""

    name: str  # "host" | "disk": the medium named in metrics and KV events
    manifest: TierManifest
    capacity_bytes: int
    stats: TierStats

    def contains(self, key: bytes) -> bool:
        """True if get(key) would probably return a payload (a damaged entry is only found by get)."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under key, verified (length and checksum); None if absent or damaged (a damaged
        entry is dropped and counted in stats.corrupt). A hit makes the entry most recently used."""
        ...

    def put(self, key: bytes, payload: bytes) -> None:
        """Store payload (exactly manifest.payload_bytes long, else ValueError) under key; a key already held is
        only touched. Drops least recently used entries to stay within capacity_bytes."""
        ...

    def close(self) -> None:
        """Finish pending writes and release the tier (a disk tier's directory lock)."""
        ...
