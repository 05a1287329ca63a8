"""A router: one policy, the live replicas, and the conversations pinned by a session key.

A request with a session key (`prompt_cache_key`, or a session header) goes where its conversation went before,
as long as that replica is alive; the policy chooses for every other request and for a conversation's first. A
request naming a target replica (RouteRequest.target_replica: the holder of a cache entry it uses) goes there
while it is alive, before any pin, and its session follows it.
Pins are LRU-bounded, so a router serving millions of sessions holds only the recent ones. The router owns the
pins; the policy owns what it learns (tree, index); every routed request reaches the policy's on_routed.
A cache-aware policy's index also says how much of the prompt another replica holds: the router records it on
the request (held_elsewhere_tokens) for the chosen replica, which names what it misses of that prefix `routed`.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence

from prefixkv.router.approximate import ApproximateRouting
from prefixkv.router.baselines import LeastLoaded, PowerOfTwo, RoundRobin
from prefixkv.router.policy import RoutingPolicy
from prefixkv.router.precise import PreciseRouting
from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest

POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PowerOfTwo, ApproximateRouting, PreciseRouting)
}


def policy_options(name: str) -> set[str]:
    """The keyword options the policy `name` takes."""
    return {p for p in inspect.signature(POLICIES[name]).parameters if p != "self"}


def create_policy(name: str, **options) -> RoutingPolicy:
    """The policy `name` with its options (e.g. block_size for the cache-aware ones); ValueError for a bad name or
    an option the policy does not take."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICIES)})")
    unknown = set(options) - policy_options(name)
    if unknown:
        known = ", ".join(sorted(policy_options(name))) or "none"
        raise ValueError(f"routing policy {name!r} has no option {', '.join(sorted(unknown))} (options: {known})")
    return POLICIES[name](**options)


class Router:
    def __init__(self, policy: RoutingPolicy, max_sessions: int = 100_000) -> None:
        self.policy = policy
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session key -> replica id, least recent first

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        """The replica for `request` among the live `replicas`; ValueError when there are none. Sets
        request.held_elsewhere_tokens for that replica."""
        if not replicas:
            raise ValueError("no live replica to route to")
        chosen = None
        target = request.target_replica
        if target is not None and any(r.replica_id == target for r in replicas):
            chosen = target
        key = request.session_key
        if key is not None and chosen is None:
            pinned = self._sessions.get(key)
            if pinned is not None and any(r.replica_id == pinned for r in replicas):
                chosen = pinned
        if chosen is None:
            chosen = self.policy.choose(request, replicas)
        if key is not None:
            self._sessions[key] = chosen
            self._sessions.move_to_end(key)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        request.held_elsewhere_tokens = self._held_elsewhere(request, replicas, chosen)
        self.policy.on_routed(request, chosen)
        return chosen

    def _held_elsewhere(self, request: RouteRequest, replicas: Sequence[ReplicaState], chosen: str) -> int:
        """The longest prompt prefix (tokens) a live replica other than `chosen` holds, asked before on_routed
        counts the prompt as the chosen one's: what `chosen` misses of it, the router could have found (the
        replica's miss cause `routed`). 0 when the policy keeps no index."""
        others = [r.replica_id for r in replicas if r.replica_id != chosen]
        if not others or not request.num_tokens:
            return 0
        held = self.policy.held_prefix_tokens(request, others)
        return max(held.values(), default=0) if held else 0

    def finished(self, request: RouteRequest, replica_id: str) -> None:
        self.policy.on_finished(request, replica_id)

    def kv_events(self, replica_id: str, events: Sequence[object]) -> None:
        """Events one replica published (the precise policy indexes them; the others ignore them)."""
        if events:
            self.policy.on_kv_events(replica_id, events)

    def remove_replica(self, replica_id: str) -> None:
        """`replica_id` died or left: its pins, tree and index entries go; its sessions re-route on their next turn."""
        for key in [k for k, r in self._sessions.items() if r == replica_id]:
            del self._sessions[key]
        self.policy.on_replica_removed(replica_id)
