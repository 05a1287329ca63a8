"""The one interface the scheduler sees for KV memory, whichever prefix cache (or none) sits behind it.

Protocol per request (all called by the scheduler/engine, never by the model runner):
  lookup(req)                 -> tokens a hit would cover now (side-effect free, used for ordering and chunk sizing)
  allocate(req, n, cached)    -> take the `cached` hit (first admission only), then pages for n more tokens;
                                 False and nothing changed if memory is short even after eviction
  page_table(req)             -> page ids, handed to the model runner
  commit(req)                 -> req.num_computed_tokens advanced: make newly computed KV findable
  free(req)                   -> finished, aborted or preempted: release pages (they stay cached until evicted)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from prefixkv.engine.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens served from the cache
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit


class KVCacheManager(ABC):
    """Pages of `page_size` token slots from one pool of `num_pages`; the runner maps slot = page * page_size + i."""

    name: str = "abstract"

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.stats = PrefixCacheStats()

    # -- queries -------------------------------------------------------------------------------------------
    @abstractmethod
    def lookup(self, request: Request) -> int:
        """Tokens of request.token_ids whose KV is cached and usable (< request.num_tokens). No side effects."""

    @abstractmethod
    def page_table(self, request: Request) -> list[int]:
        """Page ids holding the request's KV, in position order. The manager's own list (it runs every step):
        read it, don't keep or change it."""

    @abstractmethod
    def num_free_pages(self) -> int:
        """Pages an allocation could get now: free plus evictable cached ones."""

    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages()

    def usage(self) -> float:
        return self.num_used_pages() / self.num_pages

    def pages_needed(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> int:
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        return -(-total // self.page_size)

    # -- changes -------------------------------------------------------------------------------------------
    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Admit the hit (advancing request.num_computed_tokens by num_cached_tokens) and reserve pages."""

    @abstractmethod
    def commit(self, request: Request) -> None:
        """Called after a forward pass advanced request.num_computed_tokens."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's pages; computed KV stays in the cache where the cache keeps it."""

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Drop cached KV no running request holds (with salt_filter: only the namespaces whose cache_salt it
        accepts, i.e. one tenant's). False when some request still holds pages of what was to go."""
        return True

    def summary(self) -> dict:
        """A JSON-able view of the cache for humans (CLI, admin endpoint)."""
        return {
            "type": self.name,
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "free_pages": self.num_free_pages(),
            "queries": self.stats.queries,
            "hits": self.stats.hits,
            "hit_rate": self.stats.hit_rate,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError when the accounting is broken (tests call this after every operation)."""


def create_kv_cache_manager(kind: str, num_pages: int, page_size: int, hash_algo: str = "sha256") -> KVCacheManager:
    if kind == "off":
        from prefixkv.kvcache.no_cache import NoPrefixCache

        return NoPrefixCache(num_pages, page_size)
    if kind == "hash":
        from prefixkv.kvcache.hash_cache import HashPrefixCache

        return HashPrefixCache(num_pages, page_size, hash_algo=hash_algo)
    if kind == "radix":
        from prefixkv.kvcache.radix_cache import RadixPrefixCache

        return RadixPrefixCache(num_pages, page_size)
    raise ValueError(f"prefix_cache must be one of 'hash', 'radix', 'off', got {kind!r}")
