"""Which cached page goes first when the pool is full: the eviction policies both prefix caches share.

Every policy ranks an evictable page (a hash chain's tail block, a radix leaf's last page) by a priority; the
lowest goes first, ties to the least recently released. The prefix constraint is the caches' part, not the
policy's: they only offer pages nothing cached depends on (chain tails, leaves), so no policy strands descendants
it cannot reach. A page's priority is fixed when its last user releases it (GreedyDual's rule: the value is set
on access), so a parent that becomes a tail later ranks as of its own release, as LRU ranks it by its release
time; a cache stores the age at release with the page for that, and both caches rank the same page alike.

- ``lru``: priority = the logical clock of the last use. The hash cache keeps its O(1) free queue for it (the
  queue order is this priority), the radix tree a heap; behaviour is what both had before policies existed.
- ``lfu``: LFU with dynamic aging (LFU-DA, Arlitt et al., "Evaluating content management techniques for Web
  proxy caches", 2000): priority = age + uses, where age is the priority of the last page evicted. Plain LFU keeps
  pages that were hot once forever; the age makes every page released later start where the evicted ones ended,
  so old counts fade. On prefix workloads it keeps a system prompt or few-shot header hit by thousands of
  requests through a scan of one-off prompts, which LRU lets flush it (the case SGLang's frequency-aware radix
  policies, lfu and slru, were added for: RAG and batch "scan" traffic).
- ``cost``: GreedyDual-Size-Frequency (Cherkasova, "Improving WWW proxies performance with Greedy-Dual-Size-
  Frequency caching policy", 1998) with the page's recompute cost as its cost: priority = age + uses * cost /
  tokens. Recomputing a page of n tokens that starts d tokens deep costs n tokens of weights work plus attention
  over d + n/2 tokens of context per token; ``ATTENTION_CONTEXT_PER_TOKEN`` converts context to token work. Deep
  pages (long conversations, long documents) and widely shared ones are kept longest. Marconi (Pan et al.,
  "Prefix caching for the era of hybrid LLMs", MLSys 2025) argues for the same on prefix caches: rank entries by
  recency plus the compute a hit saves per byte of cache, which grows with depth since attention does.

A policy object owns one piece of state, the age; each cache owns one policy object.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from prefixkv.choices import EVICTIONS as EVICTION_POLICIES
from prefixkv.choices import check

# Context tokens whose attention costs as much as one token's pass through the weights: 2 * params FLOPs per token
# against 4 * layers * hidden per context token, so params / (2 * layers * hidden): about 3.9k for SmolLM2-135M,
# about 30k for an 8B Llama. The ranking only needs deep pages to cost more; a shallow page costs its tokens.
ATTENTION_CONTEXT_PER_TOKEN = 4096


def recompute_cost(depth_tokens: int, num_tokens: int) -> float:
    """Work to recompute a page of num_tokens tokens that starts depth_tokens deep, in token-passes."""
    return num_tokens * (1.0 + (depth_tokens + num_tokens / 2) / ATTENTION_CONTEXT_PER_TOKEN)


class EvictionPolicy:
    """Least recently used. Subclasses change the priority; callers report each eviction through evicted()."""

    name = "lru"
    uses_depth = False  # whether priority() reads depth_tokens (a radix node's depth costs a walk to the root)

    def __init__(self) -> None:
        self.age = 0.0  # priority of the last page evicted: what a page released now starts from

    def priority(self, release_age: float, last_access: int, hits: int, depth_tokens: int, num_tokens: int) -> float:
        """Rank of an evictable page: the lowest goes first. release_age: self.age when the page was released;
        last_access: the logical time of that release; hits: admissions that reused the page; depth_tokens:
        tokens before the page in its sequence."""
        return last_access

    def evicted(self, priority: float) -> None:
        if priority > self.age:
            self.age = priority


class LFUWithAging(EvictionPolicy):
    name = "lfu"

    def priority(self, release_age: float, last_access: int, hits: int, depth_tokens: int, num_tokens: int) -> float:
        return release_age + hits + 1  # its first computation counts as one use


class RecomputeCost(EvictionPolicy):
    name = "cost"
    uses_depth = True

    def priority(self, release_age: float, last_access: int, hits: int, depth_tokens: int, num_tokens: int) -> float:
        # per token, so pages of any size rank alike
        return release_age + (hits + 1) * recompute_cost(depth_tokens, num_tokens) / num_tokens


def make_eviction_policy(name: str) -> EvictionPolicy:
    policies: dict[str, type[EvictionPolicy]] = {"lru": EvictionPolicy, "lfu": LFUWithAging, "cost": RecomputeCost}
    assert tuple(policies) == EVICTION_POLICIES, "choices.Eviction names these policies"
    check("eviction", name, EVICTION_POLICIES)
    return policies[name]()


class HeapItem(Protocol):
    heap_seq: int  # the sequence number of the item's newest heap entry; older entries are stale


Item = TypeVar("Item", bound=HeapItem)


class EvictionHeap(Generic[Item]):
    """Evictable pages (blocks, leaves) by priority, lowest first, then least recently released, then pushed
    first; with lazy deletion: pushing an item again makes its older entries stale, and an entry whose item
    stopped being evictable is dropped when it surfaces."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Item]] = []
        self._seq = itertools.count(1)

    def push(self, item: Item, priority: float, last_access: int) -> None:
        seq = next(self._seq)
        item.heap_seq = seq
        heapq.heappush(self._heap, (priority, last_access, seq, item))

    def pop(self, evictable: Callable[[Item], bool]) -> tuple[float, Item] | None:
        """The lowest current entry whose item is still evictable, taken out; None when there is none."""
        heap = self._heap
        while heap:
            priority, _, seq, item = heapq.heappop(heap)
            if item.heap_seq == seq and evictable(item):
                return priority, item
        return None

    def compact(self, evictable: Callable[[Item], bool], max_entries: int) -> None:
        """Drop stale entries once there are more than max_entries (they only cost memory and pops)."""
        if len(self._heap) > max_entries:
            self._heap = [e for e in self._heap if e[3].heap_seq == e[2] and evictable(e[3])]
            heapq.heapify(self._heap)

    def current(self, evictable: Callable[[Item], bool]) -> list[tuple[float, Item]]:
        """(priority, item) of every current entry (for invariant checks)."""
        return [(p, item) for p, _, seq, item in self._heap if item.heap_seq == seq and evictable(item)]

    def __len__(self) -> int:
        return len(self._heap)
