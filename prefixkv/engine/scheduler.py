"""Decides, each step, which requests run and how many of their tokens: one token budget, running first.

Running requests (decodes and unfinished prefill chunks) are served first; waiting requests are then admitted in
the order the policy gives, each starting after its cached prefix, with long prompts cut into chunks that fit the
budget (chunked prefill). When pages run out, a running request is preempted by recompute: its pages are
released (they stay cached, so the recompute is mostly a prefix hit) and it goes back to the front of the queue.

A new prefix is computed once, whatever the policy. With a cache that keys pages in flight (the hash cache: a
chunk's pages are findable from its allocation on), a request admitted later in the same step simply hits the
pages an earlier chunk of the step computes, and reads them in the same forward pass. With one that keys them
only once computed (the radix cache), a waiting request whose next page another request computes in this same
step waits one step and hits that page instead (see Scheduler._defer).

The scheduler is the only writer of a request's progress: it counts the prefix hit as computed when the KV
manager has taken it (admit_request), and advances the request after each step (update), whoever ran the step
(the engine with the model, or the simulator with a cost model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixkv.config import EngineConfig
from prefixkv.engine.policies import SchedulingPolicy
from prefixkv.kvcache.manager import Inserted, KVCacheManager
from prefixkv.request import MultiModalHash, Request, RequestStatus, Span

logger = logging.getLogger(__name__)


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
    is mostly its own earlier pages). A first admission also learns why the rest missed (request.cache_miss,
    counted by cause in kv.stats). False, with nothing changed, when the pages are short."""
    readmission = request.num_cached_tokens >= 0
    miss = None if readmission else kv.explain_miss(request, num_cached_tokens)  # before pages are keyed
    if not kv.allocate(request, num_new_tokens, num_cached_tokens):
        return False
    request.num_computed_tokens = num_cached_tokens
    if not readmission:
        request.num_cached_tokens = num_cached_tokens
        if miss is not None:
            request.cache_miss = miss
            kv.stats.record_miss(miss)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("cache miss %s: %s", request.request_id, miss.to_json())
    kv.stats.record(request.num_tokens, num_cached_tokens, readmission=readmission)
    return True


def record_writes(request: Request, inserted: Inserted) -> None:
    """Add to request.cache_writes the prompt's part of what a commit inserted (request.py, CacheWrites): units
    wholly inside the prompt (a page holding generated tokens is no prompt write), pool pages only past the hit (a
    page it read, loaded from a tier or hit before a preemption and recomputed after, is not written too)."""
    prompt, hit = request.num_prompt_tokens, max(request.num_cached_tokens, 0)
    pool = _clip(inserted.pool, hit, prompt // inserted.page_size * inserted.page_size)
    tier = _clip(inserted.tier, 0, prompt // inserted.chunk_tokens * inserted.chunk_tokens)
    if pool or tier:
        request.cache_writes = request.cache_writes.plus(pool, tier)


def _clip(runs: tuple[Span, ...], start: int, end: int) -> list[Span]:
    return [(max(s, start), min(e, end)) for s, e in runs if max(s, start) < min(e, end)]


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
        self._hit_when_deferred: dict[Request, int] = {}  # waiting request -> its cached tokens when last deferred

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
        """After a step: each scheduled request's tokens are computed (make its new full pages findable, and
        record what it wrote) and, where its sequence was complete, the sampled token is appended (None: a
        prefill chunk, nothing sampled)."""
        for (request, num_new), token in zip(out.scheduled, sampled, strict=True):
            request.num_computed_tokens += num_new
            inserted = self.kv.commit(request)
            if inserted.pool or inserted.tier:
                record_writes(request, inserted)
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
        """Admit waiting requests in the policy's order while budget, sequences and pages last.

        A deferred request (see _defer) keeps what the policy's order gives it this step, its seat and the
        tokens it would have been granted, and its place in the waiting queue: the requests behind it get the
        same budget and seats as without the deferral, and next step its seat is free and it is tried before
        everyone the policy puts behind it. (Handing its share to the requests behind, as vLLM does with
        requests it cannot schedule yet, would let one of them take its seat for a whole generation, or its
        budget for a whole chunked prefill.) The step just skips the duplicate work. Pages short stop admission
        for everyone, as without deferral; a deferred request holds no pages. With a cache that keys pages in
        flight the lookup already finds the pages this step's chunks complete, so a request waits only for a page
        a chunk of this step ends inside.

        Nothing is freed after the first admission of a step (preemption happens only in _schedule_running, and
        admission stops when pages are short): a page keyed in flight that an admission hits is computed in
        this step by the request that keyed it."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return
        kv = self.kv
        in_flight = _PagesComputedThisStep(kv.page_size, out.scheduled, kv.keys_in_flight_pages)
        admitted: list[Request] = []
        seats = self.max_num_seqs - len(self.running)
        now = time.monotonic()
        for request in self.policy.order(self.waiting, kv, self.step_count):
            if budget <= 0 or seats <= 0:
                break
            cached = kv.lookup(request)
            num_new = min(request.num_tokens - cached, budget)
            seats -= 1
            budget -= num_new
            if self._defer(request, cached, in_flight):
                continue
            if not admit_request(kv, request, num_new, cached):
                break
            self._hit_when_deferred.pop(request, None)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            admitted.append(request)
            out.scheduled.append((request, num_new))
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in taken]

    def _defer(self, request: Request, num_cached: int, in_flight: _PagesComputedThisStep) -> bool:
        """Whether `request` waits a step because its first page not cached, [num_cached, num_cached +
        page_size), is being computed by a request already scheduled (a running request's chunk or an admission
        before it) with the same tokens, adapter, salt and multimodal inputs up to the page's end: completed in
        this step, or, with keys in flight (whose hit already has what this step completes), by the chunk that
        ends inside it. Next step it hits that page instead of computing it a second time.

        Nothing is deferred without a prefix cache, or when a hit next step could not cover a new page (a hit
        never includes the last token). It cannot starve: a request is deferred only with a longer hit than at
        its previous deferral, so at most once per page of its sequence. (The page computed this step is
        normally found next step, so the hit does grow; the bound holds even when it was evicted meanwhile.)"""
        end = num_cached + self.kv.page_size
        if not self.kv.caching or end > request.num_tokens - 1:
            return False
        if num_cached <= self._hit_when_deferred.get(request, -1):
            return False
        if not in_flight.computes_next(request, num_cached):
            return False
        self._hit_when_deferred[request] = num_cached
        return True

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
            self._hit_when_deferred.pop(request, None)
        self.kv.free(request)
        request.status = status


class _PagesComputedThisStep:
    """The pages this step's scheduled chunks complete, or reach into: what a waiting request would find cached
    next step if it waited. `scheduled` is the step's own list (during admission it only grows), read at each
    question.

    Without keys in flight a page the step completes is not in a lookup's hit yet: waiting a step finds it. With
    keys in flight it is in the hit already; what is left to wait for is a page a scheduled chunk ends inside
    (or right before): its request computes it next step, and a request that computed it now would compute it
    twice (a long shared prompt still being prefilled in chunks: the follower trails it chunk by chunk).

    No index: a question scans the step's chunks for one that ends a page at the asked position (integer tests),
    and compares tokens only for those. A step has at most max_num_seqs chunks and a few questions, while an
    index of every page in the chunks costs a tuple per page of every long prefill chunk, each step."""

    def __init__(self, page_size: int, scheduled: list[tuple[Request, int]], keyed_in_flight: bool = False) -> None:
        self.page_size = page_size
        self._scheduled = scheduled
        self._keyed_in_flight = keyed_in_flight

    def computes_next(self, request: Request, start: int) -> bool:
        """Whether a scheduled request, with the same token ids up to the end of `request`'s page [start, start +
        page_size) (start is page-aligned), the same adapter and salt and the same multimodal inputs, completes
        that page in this step (without keys in flight) or ends its chunk inside it or at its start (with them)."""
        if start % self.page_size:
            return False  # only whole pages are cached
        end = start + self.page_size
        tokens = request.token_ids
        page: list[int] | None = None
        for other, num_new in self._scheduled:
            done = other.num_computed_tokens
            reached = done + num_new
            waits = start <= reached < end if self._keyed_in_flight else done < end <= reached
            if not waits or other.extra_keys != request.extra_keys:
                continue
            if page is None:
                page = tokens[start:end]
            if other.token_ids[start:end] != page or other.token_ids[:start] != tokens[:start]:
                continue
            if _mm_before(other, end) == _mm_before(request, end):
                return True
        return False


def _mm_before(request: Request, end: int) -> list[MultiModalHash]:
    return [m for m in request.mm_hashes if m.offset < end]
