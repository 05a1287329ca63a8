"""What a prefix cache reports about itself, typed: the pool, the admissions' hits, retention, and per namespace
(a tenant's cache_salt with an adapter) what it holds.

Every row that belongs to a namespace names it the same way (cache_salt, lora_id), so a reader (the admin
endpoint's tenant view) filters rows by tenant without knowing which cache made them. What only one kind of cache
has (block size and hash algorithm, tree nodes, a second tier's figures) is in `details`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class NamespaceUsage:
    """One namespace's share of the cache."""

    cache_salt: str | None
    lora_id: str | None
    cached_tokens: int
    hits: int | None = None  # admissions that hit it: the radix tree counts them, the hash chain does not


@dataclass(slots=True)
class HotPrefix:
    """One of the most hit cached prefixes (the radix tree's)."""

    cache_salt: str | None
    lora_id: str | None
    tokens: int  # its length
    hits: int
    locks: int  # running requests holding it


@dataclass
class CacheSummary:
    type: str  # "hash" | "radix" | "off"
    num_pages: int
    page_size: int
    free_pages: int
    queries: int  # prompt tokens looked up at first admission
    hits: int
    hit_rate: float
    readmission_queries: int
    readmission_hits: int
    evicted_pages: int
    retained_pages: int
    retained_capacity: int
    retention_released_by_cap: int
    retention_expired: int
    cached_tokens: int = 0
    running_requests: int = 0
    by_namespace: list[NamespaceUsage] = field(default_factory=list)
    top_prefixes: list[HotPrefix] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # what only this kind of cache reports

    def to_json(self) -> dict[str, Any]:
        """One flat JSON object: the common fields, the rows, and the details beside them."""
        out = asdict(self)
        details = out.pop("details")
        return {**out, **details}
