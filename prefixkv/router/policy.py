"""The interface every routing policy implements, and the load ordering the baselines share.

A policy picks one replica for a request from the live replicas' states. Policies that learn from their own
decisions (the approximate tree) or from the replicas (the precise index) hear about routed and finished
requests and about replicas that leave through the hooks; the others ignore them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest


class RoutingPolicy(ABC):
    name: str = "abstract"

    @abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> str:
        """The id of the replica to serve `request`; `replicas` is non-empty and lists live replicas only."""

    def on_routed(self, request: RouteRequest, replica_id: str) -> None:  # noqa: B027 - optional hook
        """`request` was sent to `replica_id` (by this policy or by a session pin)."""

    def on_finished(self, request: RouteRequest, replica_id: str) -> None:  # noqa: B027 - optional hook
        """`request` finished (or failed) on `replica_id`."""

    def on_kv_events(self, replica_id: str, events: Sequence[object]) -> None:  # noqa: B027 - optional hook
        """KV events `replica_id` published (BlockStored, BlockRemoved, AllBlocksCleared), in order."""

    def on_replica_removed(self, replica_id: str) -> None:  # noqa: B027 - optional hook
        """`replica_id` is gone (dead or scaled down): forget everything about it."""

    def held_prefix_tokens(self, request: RouteRequest, replica_ids: Sequence[str]) -> dict[str, int] | None:
        """Per replica, how many leading prompt tokens this policy believes it holds; None: it keeps no index.
        The router tells the chosen replica what another holds, so the replica can name that miss `routed`."""
        return None


def load_key(replica: ReplicaState) -> tuple:
    """Least loaded first: fewer requests in flight, then less KV in use, then the id (a stable tie-break)."""
    return (replica.load, replica.kv_usage, replica.replica_id)


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    return min(replicas, key=load_key)
