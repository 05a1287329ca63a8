"""prefixkv.router behind Ray Serve's RequestRouter extension point.

Ray Serve asks `choose_replicas` for ranked groups of replicas and then sends the request to the least loaded
replica of the first group that accepts it; this adapter answers with one group of one replica, the one
prefixkv's Router chose, so the policy (round-robin, least-loaded, approximate, precise...) decides alone and Ray
keeps its backpressure (max_ongoing_requests) and retries. Load gauges come from each replica's routing stats
(replica.py's record_routing_stats, polled by Ray's controller); KV events (precise policy) come straight from
each replica's ZMQ publisher, drained before every decision; a replica Ray reports dead leaves the Router, so
its pins and index entries go with it. Router.route records on the request's RouteRequest how much of the prompt
another replica holds; Ray sends the arguments only after choose_replicas returns, so the replica gets it
(replica.py turns it into the header that lets the engine name those misses `routed`).

Addressing one replica: a RouteRequest's target_replica (the holder of a cache entry the request names) goes there
while it is alive. Addressing all: choose_replicas records the live replica ids on the RouteRequest, which the
ingress (this router runs in its process) reads back after the call and then targets each id (cache listings).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixkv.kv_events.subscriber import KVEventSubscriber
from prefixkv.router import ReplicaState, Router, RouteRequest, create_policy
from prefixkv.serve_ray import router_view
from prefixkv.serve_ray.messages import ForwardedRequest

logger = logging.getLogger("ray.serve")  # Serve's logger: lines land in the Serve logs of the process routing


def replica_state(replica: RunningReplica, ongoing: int = 0) -> ReplicaState:
    """What the policy scores one replica on, from its last routing stats (zeros until the first poll). Stats are
    polled once a second, so a burst would see every replica idle: `ongoing`, the requests this router has sent
    there that have not completed, is a floor on its load."""
    stats: dict[str, Any] = replica.routing_stats or {}
    waiting = int(stats.get("num_requests_waiting", 0))
    return ReplicaState(
        replica_id=replica.replica_id.unique_id,
        waiting=waiting,
        running=max(int(stats.get("num_requests_running", 0)), ongoing - waiting),
        kv_usage=float(stats.get("kv_cache_usage", 0.0)),
        cached_blocks=int(stats.get("num_cached_pages", 0)),
    )


class PrefixkvRequestRouter(RequestRouter):
    """Selected with RequestRouterConfig(request_router_class=PrefixkvRequestRouter,
    request_router_kwargs={"policy": NAME, **policy_options})."""

    def initialize_state(self, policy: str = "round-robin", **options: Any) -> None:
        self.router = Router(create_policy(policy, **options))
        self._subscribers: dict[str, KVEventSubscriber] = {}  # replica id -> its KV event stream
        router_view.register(self)

    def states(self, replicas: list[RunningReplica]) -> list[ReplicaState]:
        """What the policy would score `replicas` on now: their last routing stats, floored by the count of the
        requests this process's routers sent there and that have not completed (router_view.py)."""
        return [replica_state(r, router_view.in_flight(r.replica_id.unique_id)) for r in replicas]

    def view(self) -> dict[str, dict[str, Any]]:
        """Replica id -> the state it would be routed on now, and `sent_unanswered`: the requests this process's
        routers sent there that have not completed."""
        return {
            state.replica_id: {
                **dataclasses.asdict(state),
                "load": state.load,
                "sent_unanswered": router_view.in_flight(state.replica_id),
            }
            for state in self.states(list(self.curr_replicas.values()))
        }

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        router_view.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        router_view.completed(replica_id.unique_id)

    def _apply_kv_events(self, replicas: list[RunningReplica]) -> None:
        """Feed the policy every KV event the replicas published since the last request (non-blocking). A replica's
        stream is subscribed to once its stats name it; a gap no replay could fill drops that replica's index
        entries (they are rebuilt from its later events) rather than trust a view that has diverged."""
        for replica in replicas:
            rid = replica.replica_id.unique_id
            endpoint = (replica.routing_stats or {}).get("kv_events_endpoint")
            if rid not in self._subscribers and endpoint:
                replay = (replica.routing_stats or {}).get("kv_events_replay_endpoint")
                self._subscribers[rid] = KVEventSubscriber(endpoint, replay)
                logger.info("subscribed to replica %s's KV events at %s", rid, endpoint)
            subscriber = self._subscribers.get(rid)
            if subscriber is None:
                continue
            lost = subscriber.lost
            while batches := subscriber.receive(timeout=0):
                for _, _, events in batches:
                    self.router.kv_events(rid, events)
                    logger.debug("replica %s: %d KV events applied", rid, len(events))
            if subscriber.lost != lost:
                logger.warning("replica %s: KV events lost beyond replay; its index entries are dropped", rid)
                self.router.policy.on_replica_removed(rid)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._apply_kv_events(candidate_replicas)
        states = self.states(candidate_replicas)
        route = _route_request(pending_request)
        chosen = self.router.route(route, states)
        route.live_replicas = tuple(sorted(by_id))  # read back by the ingress, in this process (cache entries)
        return [[by_id[chosen]]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.remove_replica(replica_id.unique_id)
        router_view.forget(replica_id.unique_id)
        subscriber = self._subscribers.pop(replica_id.unique_id, None)
        if subscriber is not None:
            subscriber.close()


def _route_request(pending_request: PendingRequest | None) -> RouteRequest:
    """The RouteRequest the ingress attached (a forwarded request's, or one passed alone to a replica method such as
    holds_cache_entry); an empty one for a call that carries none (a health probe)."""
    if pending_request is not None:
        for arg in pending_request.args:
            if isinstance(arg, ForwardedRequest):
                return arg.route
            if isinstance(arg, RouteRequest):
                return arg
    return RouteRequest(token_ids=[])
