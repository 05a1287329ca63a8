"""Decides, each step, which requests run and how many of their tokens: one token budget, running first.

Running requests (decodes and unfinished prefill chunks) are served first; waiting requests are then admitted in
the order the policy gives, each starting after its cached prefix, with long prompts cut into chunks that fit the
budget (chunked prefill). When pages run out, a running request is preempted by recompute: its pages are
released (they stay cached, so the recompute is mostly a prefix hit) and it goes back to the front of the queue.

The scheduler is the only writer of a request's progress: it counts the prefix hit as computed when the KV
manager has taken it (admit_request), and advances the request after each step (update), whoever ran the step
(the engine with the model, or the simulator with a cost model).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixkv.config import EngineConfig
from prefixkv.engine.policies import SchedulingPolicy
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def admit_request(kv: KVCacheManager, request: Request, num_new_tokens: int, num_cached_tokens: int) -> bool:
    """Let `kv` take the hit and reserve pages for num_new_tokens more; once it has, the hit's tokens count as
    computed. The hit rate counts first admissions; a preempted request coming back is counted apart (its hit
    is mostly its own earlier pages). False, with nothing changed, when the pages are short."""
    if not kv.allocate(request, num_new_tokens, num_cached_tokens):
        return False
    request.num_computed_tokens = num_cached_tokens
    readmission = request.num_cached_tokens >= 0
    if not readmission:
        request.num_cached_tokens = num_cached_tokens
    kv.stats.record(request.num_tokens, num_cached_tokens, readmission=readmission)
    return True


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

    def update(self, out: SchedulerOutput, sampled: Sequence[int | None]) -> None:
        """After a step: each scheduled request's tokens are computed (make its new full pages findable) and,
        where its sequence was complete, the sampled token is appended (None: a prefill chunk, nothing sampled)."""
        for (request, num_new), token in zip(out.scheduled, sampled, strict=True):
            request.num_computed_tokens += num_new
            self.kv.commit(request)
            if token is not None:
                request.token_ids.append(token)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Each running request, in admission order, gets its next chunk. When pages are short, the policy's
        victim is preempted (tokens it got this step come back to the budget) and the allocation retried; when
        the victim is the request itself, it is out and the next one is served."""
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is RequestStatus.PREEMPTED:  # a victim of an earlier request's allocation
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request, num_new):
                victim = self.policy.preemption_victim(self.running)
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
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
            if not admit_request(kv, request, num_new, cached):
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

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Release the victim's pages and queue it first for recompute; return the tokens it had this step."""
        self.running.remove(victim)
        given_back = 0
        for k, (request, num_new) in enumerate(out.scheduled):
            if request is victim:
                del out.scheduled[k]
                given_back = num_new
                break
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, victim)
        out.preempted.append(victim)
        return given_back

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and release its pages (they stay cached)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
