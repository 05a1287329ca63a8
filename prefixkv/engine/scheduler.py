"""Decides, each step, which requests run and how many of their tokens: one token budget, running first.

Running requests (decodes and unfinished prefill chunks) are served first; waiting requests are then admitted in
the order the policy gives, each starting after its cached prefix, with long prompts cut into chunks that fit the
budget (chunked prefill). When pages run out, a running request is preempted by recompute: its pages are
released (they stay cached, so the recompute is mostly a prefix hit) and it goes back to the front of the queue.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prefixkv.config import EngineConfig
from prefixkv.engine.policies import SchedulingPolicy
from prefixkv.engine.request import Request, RequestStatus
from prefixkv.kvcache.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: SchedulingPolicy) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv = kv
        self.policy = policy
        self.waiting: list[Request] = []  # arrival order; preempted requests go back to the front
        self.running: list[Request] = []  # admission order
        self.step_count = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_step = self.step_count
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # pages are short: admitting more would only preempt again
            self._admit_waiting(out, budget)
        self.step_count += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        kv = self.kv
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not kv.allocate(request, num_new):
                victim = self.policy.preemption_victim(self.running)
                j = self.running.index(victim)
                self.running.pop(j)
                for k, (r, n) in enumerate(out.scheduled):
                    if r is victim:  # already given tokens this step: take them back
                        del out.scheduled[k]
                        budget += n
                        break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
                if j < i:
                    i -= 1
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            # the request itself was preempted: whatever stands at index i now is next
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return
        kv = self.kv
        admitted: list[Request] = []
        now = time.monotonic()
        for request in self.policy.order(self.waiting, kv, self.step_count):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            cached = kv.lookup(request)
            if self.policy.should_defer(request, cached, admitted, kv):
                continue
            num_new = min(request.num_tokens - cached, budget)
            if not kv.allocate(request, num_new, cached):
                break
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            admitted.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in taken]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and release its pages (they stay cached)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
