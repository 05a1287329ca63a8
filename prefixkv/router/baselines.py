"""The cache-blind policies every router ships and every evaluation compares against."""

from __future__ import annotations

import random
from collections.abc import Sequence

from prefixkv.router.policy import RoutingPolicy, least_loaded
from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest


class RoundRobin(RoutingPolicy):
    """Each replica in turn (by id order, so a replica that leaves or joins shifts the turn, not the order)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        ordered = sorted(r.replica_id for r in replicas)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen


class LeastLoaded(RoutingPolicy):
    """The replica with the fewest requests in flight (ties: less KV in use, then the id)."""

    name = "least-loaded"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        return least_loaded(replicas).replica_id


class PowerOfTwo(RoutingPolicy):
    """Two replicas drawn at random, the less loaded of them: near least-loaded balance without every router
    herding onto the same replica when several route from stale gauges (Mitzenmacher's power of two choices)."""

    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        if len(replicas) == 1:
            return replicas[0].replica_id
        return least_loaded(self._rng.sample(list(replicas), 2)).replica_id
