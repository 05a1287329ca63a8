"""What any prefix cache could hit on a trace: the unbounded-cache figure and an offline (Belady) bound.

A hit rate alone says little: 30% is poor if 37% was reachable and excellent if 31% was. Both figures here use
the engine's rules for a hit (whole pages, the request's leading run of cached pages, at most prompt_len - 1
tokens) on a sequential model of the trace (requests one after another in arrival order), so a simulator or
engine run can report achieved / bound.

Pages are identified without looking at tokens: the trace's block ids form a trie (a node per distinct leading
run of ids), and a page is (the trie node of the block holding its last token, that token's offset in the block).
Two prompts share a page exactly when they share the token prefix up to its end, because scale_trace maps
distinct ids to distinct runs. That keeps the full Mooncake trace at 16-token pages (~9M page accesses) in numpy
arrays instead of per-token Python.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class BlockPrompt(Protocol):
    """What the bounds read from a request (ScaledRequest has it): a prompt as runs of trace blocks."""

    @property
    def prompt_len(self) -> int: ...
    @property
    def block_ids(self) -> tuple[int, ...]: ...
    @property
    def tokens_per_block(self) -> int: ...


@dataclass(frozen=True)
class HitBound:
    hit_tokens: int
    prompt_tokens: int
    per_request: tuple[int, ...]  # hit tokens of each request, in arrival order
    capacity_pages: int | None = None  # None: unbounded
    evictions: int = 0

    @property
    def rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class PageAccesses:
    """Every request's full prompt pages as dense page ids (0..num_pages-1), concatenated in arrival order.

    starts[r]:starts[r + 1] are request r's pages, first to last; eligible[r] is how many of them may hit (the
    engine leaves at least one prompt token to compute); depth[p] is page p's index in any prompt holding it.
    """

    pages: np.ndarray
    starts: np.ndarray
    eligible: np.ndarray
    depth: np.ndarray
    prompt_tokens: int
    page_size: int

    @property
    def num_requests(self) -> int:
        return len(self.starts) - 1

    @property
    def num_pages(self) -> int:
        return len(self.depth)


def page_accesses(requests: Sequence[BlockPrompt], page_size: int) -> PageAccesses:
    """The trace as page accesses, computed once and shared by both bounds (the costly part on a long trace)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    trie: dict[tuple[int, int], int] = {}
    keys: list[np.ndarray] = []
    counts = np.zeros(len(requests) + 1, dtype=np.int64)
    eligible = np.zeros(len(requests), dtype=np.int64)
    per_block = requests[0].tokens_per_block if requests else 1
    for r, req in enumerate(requests):
        if req.tokens_per_block != per_block:
            raise ValueError(f"request {r} has {req.tokens_per_block} tokens per block, request 0 has {per_block}")
        node, nodes = 0, []
        for block in req.block_ids:
            node = trie.setdefault((node, block), len(trie) + 1)
            nodes.append(node)
        last_tokens = np.arange(1, req.prompt_len // page_size + 1, dtype=np.int64) * page_size - 1
        node_of = np.asarray(nodes, dtype=np.int64)[last_tokens // per_block]
        keys.append(node_of * per_block + last_tokens % per_block)
        counts[r + 1] = len(last_tokens)
        eligible[r] = (req.prompt_len - 1) // page_size
    flat = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    unique, dense = np.unique(flat, return_inverse=True)
    depth = np.zeros(len(unique), dtype=np.int64)
    starts = np.cumsum(counts)
    position = np.arange(len(flat), dtype=np.int64) - np.repeat(starts[:-1], counts[1:])
    depth[dense] = position
    prompt_tokens = sum(req.prompt_len for req in requests)
    return PageAccesses(dense.astype(np.int64), starts, eligible, depth, prompt_tokens, page_size)


def _accesses(requests: Sequence[BlockPrompt] | PageAccesses, page_size: int) -> PageAccesses:
    if not isinstance(requests, PageAccesses):
        return page_accesses(requests, page_size)
    if requests.page_size != page_size:
        raise ValueError(f"the page accesses were made for {requests.page_size}-token pages, not {page_size}")
    return requests


def _leading_run(mask: np.ndarray) -> int:
    return len(mask) if mask.all() else int(mask.argmin())


def unbounded_hit_tokens(requests: Sequence[BlockPrompt] | PageAccesses, page_size: int) -> HitBound:
    """Compulsory misses only: each request hits the leading run of its pages that an earlier request held."""
    acc = _accesses(requests, page_size)
    seen = np.zeros(acc.num_pages, dtype=bool)
    hits = []
    for r in range(acc.num_requests):
        pages = acc.pages[acc.starts[r] : acc.starts[r + 1]]
        hits.append(_leading_run(seen[pages[: acc.eligible[r]]]) * acc.page_size)
        seen[pages] = True
    return HitBound(sum(hits), acc.prompt_tokens, tuple(hits))


def next_uses(acc: PageAccesses) -> np.ndarray:
    """For each access (request r, page p): the next request after r where p may hit; num_requests if none."""
    n = acc.num_requests
    request_of = np.repeat(np.arange(n, dtype=np.int64), np.diff(acc.starts))
    position = np.arange(len(acc.pages), dtype=np.int64) - acc.starts[request_of]
    counted = position < acc.eligible[request_of]  # a request's last page, when it ends the prompt, cannot hit
    combined = acc.pages * (n + 1) + request_of
    order = np.argsort(combined[counted], kind="stable")
    sorted_pages = acc.pages[counted][order]
    sorted_requests = request_of[counted][order]
    sorted_combined = combined[counted][order]
    # the first counted access of page p after request r: the next entry of the (page, request) order
    at = np.searchsorted(sorted_combined, combined, side="right")
    found = at < len(sorted_combined)
    at = np.minimum(at, len(sorted_combined) - 1) if len(sorted_combined) else at
    result = np.full(len(acc.pages), n, dtype=np.int64)
    if len(sorted_combined):
        same = found & (sorted_pages[at] == acc.pages)
        result[same] = sorted_requests[at][same]
    return result


def offline_hit_tokens(requests: Sequence[BlockPrompt] | PageAccesses, page_size: int, capacity_pages: int) -> HitBound:
    """An offline reference for a pool of `capacity_pages`: Belady's MIN on pages with the prefix constraint.

    Requests run one at a time in arrival order; a request hits the leading run of its pages in the cache, then
    all its prompt pages enter the cache (the first capacity_pages of them if it is longer than the pool); room
    is made by evicting the page whose next hit-eligible use is furthest away (never used again counts as
    furthest), deeper pages first on ties, never a page of the request being served. Because a page's next use is
    never earlier than its parent's, that rule keeps the cache prefix-closed, so a request's cached pages are its
    leading run and MIN's classic optimality carries over: no policy gets more hits in this model.

    Relaxations against a real engine (each can only raise the figure or leave it): sequential (no concurrency: in
    the engine, running requests pin pages and simultaneous requests miss on each other's prefixes), no
    pinning beyond the current request, decode pages neither count nor take room, and future knowledge.
    """
    if capacity_pages < 1:
        raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
    acc = _accesses(requests, page_size)
    nexts = next_uses(acc)
    page_bits = max(acc.num_pages, 1).bit_length()
    depth_bits = max(int(acc.depth.max(initial=0)), 1).bit_length()
    if page_bits + depth_bits + (acc.num_requests + 1).bit_length() > 62:
        raise ValueError("trace too large for the packed eviction keys")
    page_mask = (1 << page_bits) - 1
    cached = np.zeros(acc.num_pages, dtype=bool)
    serving = np.full(acc.num_pages, -1, dtype=np.int64)  # the request now holding the page (protected)
    current_key = np.zeros(acc.num_pages, dtype=np.int64)
    heap: list[int] = []  # -(next use, depth, page) packed in one int: a max-heap; stale entries skipped lazily
    size = evictions = 0
    hits = []
    for r in range(acc.num_requests):
        lo, hi = acc.starts[r], acc.starts[r + 1]
        pages = acc.pages[lo:hi]
        hits.append(_leading_run(cached[pages[: acc.eligible[r]]]) * acc.page_size)
        pages, keys = pages[:capacity_pages], nexts[lo:hi][:capacity_pages]
        keys = (((keys << depth_bits) | acc.depth[pages]) << page_bits) | pages
        serving[pages] = r
        excess = size + int(np.count_nonzero(~cached[pages])) - capacity_pages
        while excess > 0:
            entry = -heapq.heappop(heap)
            page = entry & page_mask
            if not cached[page] or current_key[page] != entry:
                continue
            if serving[page] == r:  # the request being served holds it; its new key is pushed below
                continue
            cached[page] = False
            size -= 1
            excess -= 1
            evictions += 1
        size += int(np.count_nonzero(~cached[pages]))
        cached[pages] = True
        current_key[pages] = keys
        for entry in keys.tolist():
            heapq.heappush(heap, -entry)
        if len(heap) > 4 * capacity_pages + 65_536:  # drop stale entries so memory follows the pool, not the trace
            live = np.asarray(heap, dtype=np.int64)
            live_pages = -live & page_mask
            heap = np.unique(live[cached[live_pages] & (current_key[live_pages] == -live)]).tolist()
            heapq.heapify(heap)
    return HitBound(sum(hits), acc.prompt_tokens, tuple(hits), capacity_pages, evictions)
