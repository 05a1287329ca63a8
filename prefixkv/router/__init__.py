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

__all__ = [
    "POLICIES",
    "ApproximateRouting",
    "BlockIndex",
    "LeastLoaded",
    "PowerOfTwo",
    "PreciseRouting",
    "ReplicaState",
    "RouteRequest",
    "RoundRobin",
    "Router",
    "RoutingPolicy",
    "create_policy",
    "policy_options",
]
