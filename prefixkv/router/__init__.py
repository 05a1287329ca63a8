"""Routing requests across engine replicas, pure Python (no model, no torch): the same code runs in the server's
replica deployment and in the simulator. See router.py for the entry point."""

from prefixkv.router.approximate import ApproximateRouting
from prefixkv.router.baselines import LeastLoaded, PowerOfTwo, RoundRobin
from prefixkv.router.block_index import BlockIndex
from prefixkv.router.policy import RoutingPolicy
from prefixkv.router.precise import PreciseRouting
from prefixkv.router.replica import ReplicaState
from prefixkv.router.request import RouteRequest
from prefixkv.router.router import POLICIES, Router, create_policy, policy_options
from prefixkv.router.store_index import MEDIUM_REMOTE, SharedStoreIndex

__all__ = [
    "POLICIES",
    "ApproximateRouting",
    "BlockIndex",
    "LeastLoaded",
    "MEDIUM_REMOTE",
    "PowerOfTwo",
    "PreciseRouting",
    "ReplicaState",
    "RouteRequest",
    "RoundRobin",
    "Router",
    "RoutingPolicy",
    "SharedStoreIndex",
    "create_policy",
    "policy_options",
]
