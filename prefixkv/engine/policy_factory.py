"""Builds the scheduling policy an EngineConfig names: the one module that knows every policy, so the base
classes in policies.py import none of the policies built on them."""

from __future__ import annotations

from prefixkv.config import EngineConfig
from prefixkv.engine import cache_aware_policies
from prefixkv.engine.policies import FCFSPolicy, PriorityPolicy, SchedulingPolicy


def create_policy(config: EngineConfig) -> SchedulingPolicy:
    if config.schedule_policy == "fcfs":
        return FCFSPolicy()
    if config.schedule_policy == "priority":
        return PriorityPolicy()
    return cache_aware_policies.create(config)
