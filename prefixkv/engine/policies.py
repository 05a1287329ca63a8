"""Orders the waiting queue. The scheduler admits requests in the order a policy returns.

What a policy does not decide: whether a request waits a step for a page another request is computing in the
same step (the scheduler does that for every policy, for caches without keys_in_flight_pages, see
Scheduler._defer)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request


class SchedulingPolicy(ABC):
    name = "abstract"

    @abstractmethod
    def order(self, waiting: list[Request], kv: KVCacheManager, step: int) -> list[Request]:
        """Waiting requests in the order the scheduler should try to admit them this step."""

    def preemption_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when pages run out: the most recently admitted one."""
        return running[-1]


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def order(self, waiting, kv, step):
        return waiting  # the scheduler keeps waiting in arrival order (preempted requests go back to the front)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def order(self, waiting, kv, step):
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))

    def preemption_victim(self, running):
        return max(running, key=lambda r: (r.priority, r.arrival_time))
