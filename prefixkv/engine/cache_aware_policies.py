"""Scheduling policies that look at the prefix cache: lpm, dfs-weight (both from SGLang), bounded-lpm (ours) and
k-lpm.

All of them work with any KV manager through `kv.lookup`; dfs-weight also needs the identity of the cached prefix
(`kv.prefix_path`: tree nodes on the radix cache, block keys on the hash cache) and degrades to FCFS without a
cache.

Why order at all: with a pool that holds one hot prefix, FCFS alternates between groups and evicts each prefix
just before it is needed again (thrashing). Serving the requests that hit first keeps the hot prefix resident.
LPM's flaw is starvation: a request whose prefix is cold is passed over as long as hot requests keep coming.
bounded-lpm keeps LPM's order but no request waits more than `max_wait_steps` steps behind it; k-lpm gives every
k-th place to the oldest waiting request.
"""

from __future__ import annotations

import heapq

from prefixkv.config import EngineConfig
from prefixkv.engine.policies import SchedulingPolicy
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request


def lpm_order(waiting: list[Request], kv: KVCacheManager) -> list[Request]:
    """Longest cached prefix first; the sort is stable, so ties keep queue order (arrival, preempted first)."""
    hits = {id(r): kv.lookup(r) for r in waiting}
    return sorted(waiting, key=lambda r: -hits[id(r)])


class LPMPolicy(SchedulingPolicy):
    """Longest prefix match. Past `fallback_threshold` waiting requests it orders FCFS like SGLang (None: never;
    the caches memoise lookups per request, so 4096 waiting requests cost milliseconds)."""

    name = "lpm"

    def __init__(self, fallback_threshold: int | None = None) -> None:
        self.fallback_threshold = fallback_threshold

    def _fallback(self, waiting: list[Request]) -> bool:
        return self.fallback_threshold is not None and len(waiting) > self.fallback_threshold

    def order(self, waiting, kv, step):
        return list(waiting) if self._fallback(waiting) else lpm_order(waiting, kv)


class DFSWeightPolicy(SchedulingPolicy):
    """SGLang's dfs-weight: lay the waiting requests on the tree of their cached prefixes, weight each node by
    the requests below it, and walk depth-first taking heavier subtrees first; a node's own requests come after
    its children's (deeper hits first). Requests sharing a cached prefix run together while it is resident."""

    name = "dfs-weight"

    def order(self, waiting, kv, step):
        root = object()
        children: dict = {root: []}
        weight: dict = {}
        own: dict = {}
        for request in waiting:
            parent = root
            for node in kv.prefix_path(request):
                if node not in weight:
                    weight[node] = 0
                    children[node] = []
                    children[parent].append(node)  # first appearance order breaks weight ties: arrival order
                weight[node] += 1
                parent = node
            own.setdefault(parent, []).append(request)

        out: list[Request] = []
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(own.get(node, ()))
                continue
            stack.append((node, True))
            kids = sorted(children[node], key=lambda n: -weight[n])
            stack.extend((kid, False) for kid in reversed(kids))
        return out


class BoundedLPMPolicy(LPMPolicy):
    """LPM with a bound on overtaking.

    Order: LPM, except that no request is placed ahead of one that arrived more than `max_wait_steps` steps
    before it. So a request is passed over by newer ones only during its first max_wait_steps steps; after that
    it stands ahead of every newcomer, and once it is first only a full pool keeps it out (the scheduler admits
    nobody behind a request that does not fit). With a steady hot stream and one cold request, the cold one waits
    about max_wait_steps plus the time the hot running requests take to drain: plain LPM lets it wait as long
    as the hot stream lasts. Unlike "overdue requests first, oldest first", the rule never degrades to FCFS order
    when a backlog builds up: requests that arrived within max_wait_steps of each other still go in LPM order,
    so groups sharing a prefix stay together and the pool does not thrash.

    A request whose new pages another one computes in the same step waits a step for them under every policy
    (Scheduler._defer; the hash cache lets it hit them in that step instead), overdue requests included: that
    wait is bounded by its own pages, not by newcomers, and the bound here is about order, which deferral leaves
    alone.
    """

    name = "bounded-lpm"

    def __init__(self, max_wait_steps: int = 128, fallback_threshold: int | None = None) -> None:
        super().__init__(fallback_threshold)
        if max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {max_wait_steps}")
        self.max_wait_steps = max_wait_steps

    def order(self, waiting, kv, step):
        if not waiting or self._fallback(waiting):
            return list(waiting)
        bound = self.max_wait_steps
        by_age = sorted(range(len(waiting)), key=lambda i: waiting[i].arrival_step)
        if waiting[by_age[-1]].arrival_step - waiting[by_age[0]].arrival_step <= bound:
            return lpm_order(waiting, kv)  # everyone arrived within the bound of each other: plain LPM
        # Greedy: repeatedly emit the best LPM candidate among the requests that arrived at most `bound` steps
        # after the oldest one not yet emitted. Each request enters the heap once: O(n log n).
        hit = [kv.lookup(r) for r in waiting]
        out: list[Request] = []
        done = [False] * len(waiting)
        heap: list[tuple[int, int]] = []
        oldest = entered = 0
        while len(out) < len(waiting):
            while done[by_age[oldest]]:
                oldest += 1
            limit = waiting[by_age[oldest]].arrival_step + bound
            while entered < len(by_age) and waiting[by_age[entered]].arrival_step <= limit:
                i = by_age[entered]
                heapq.heappush(heap, (-hit[i], i))  # ties: queue order (arrival, preempted first)
                entered += 1
            _, i = heapq.heappop(heap)
            done[i] = True
            out.append(waiting[i])
        return out


class KLPMPolicy(LPMPolicy):
    """k-LPM: the order is made of groups of k, each the oldest waiting request not yet placed followed by the
    k-1 others with the longest cached prefix (ties: queue order). Oldest means first in the waiting queue, as
    FCFS sees it (arrival order, preempted requests in front). k=1 is FCFS; a large k approaches LPM.

    A bound on overtaking counted in places, not steps: every group takes one request older than all the others
    left, so a request with p requests ahead of it in the queue is placed within the first p+1 groups however
    many newer requests hit the cache, and the queue's oldest request is always first. Unlike bounded-lpm, the
    oldest request goes first even when it is cold, so a backlog of old cold requests admits one of them per k
    admissions and the rest by prefix.

    Cost: one lookup per request (memoised by the caches) and one sort by hit: O(n log n), then one pass."""

    name = "k-lpm"

    def __init__(self, k: int = 4, fallback_threshold: int | None = None) -> None:
        super().__init__(fallback_threshold)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k

    def order(self, waiting, kv, step):
        if self.k == 1 or len(waiting) <= 1 or self._fallback(waiting):
            return list(waiting)
        n = len(waiting)
        hit = [kv.lookup(r) for r in waiting]
        by_hit = iter(sorted(range(n), key=hit.__getitem__, reverse=True))  # stable: ties keep queue order
        placed = bytearray(n)
        out: list[Request] = []
        oldest = 0
        while len(out) < n:
            while placed[oldest]:
                oldest += 1
            placed[oldest] = 1
            out.append(waiting[oldest])
            room = min(self.k - 1, n - len(out))
            for i in by_hit if room else ():  # the longest hits not placed yet, each looked at once
                if not placed[i]:
                    placed[i] = 1
                    out.append(waiting[i])
                    room -= 1
                    if not room:
                        break
        return out


def create(config: EngineConfig) -> SchedulingPolicy:
    name = config.schedule_policy
    if name == "lpm":
        return LPMPolicy(config.lpm_fallback_threshold)
    if name == "dfs-weight":
        return DFSWeightPolicy()
    if name == "bounded-lpm":
        return BoundedLPMPolicy(config.max_wait_steps, config.lpm_fallback_threshold)
    if name == "k-lpm":
        return KLPMPolicy(config.lpm_k, config.lpm_fallback_threshold)
    raise ValueError(f"not a cache-aware policy: {name!r}")
