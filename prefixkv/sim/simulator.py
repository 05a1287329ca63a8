"""A model-free engine loop: the engine core's step (engine/core.py) with a cost model in place of the model.

Each step is the engine's own: the real Scheduler and KV manager schedule and record it, through the same
EngineCore.step the engine runs; only the Executor differs. CostModelExecutor "computes" every scheduled chunk
instantly, advances the simulated clock by the cost model's time for the step's batch (cost_model.BatchShape)
and makes up a token for each request whose sequence is complete. The clock jumps to the next arrival when there
is nothing to do, and it is injected where simulated time is read (retention deadlines: build the KV manager with
clock=sim_clock.now). Hit rates, waits, preemptions and evictions are exact for the scheduler and caches as
implemented (the same code the engine runs); times are as good as the cost model.

Arrivals are due either at a simulated time (`simulate_trace`: a trace's timestamps) or at a scheduler step
(`simulate`: the step-driven workloads of the benchmarks and tests). One loop serves both. Only per-request
metrics outlive a request: its token list is released when it finishes, so a trace of a hundred million prompt
tokens runs in the memory of the requests in flight.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixkv.batch import Sample
from prefixkv.cache_miss import CAUSES
from prefixkv.choices import SchedulePolicy
from prefixkv.config import EngineConfig
from prefixkv.engine.core import EngineCore, StepComponent
from prefixkv.engine.policies import SchedulingPolicy
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.scheduler import Scheduler, SchedulerOutput
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request, RequestStatus
from prefixkv.request_options import RequestOptions, Retention
from prefixkv.sampling_params import SamplingParams
from prefixkv.session_hint import SessionHint
from prefixkv.sim.cost_model import BatchShape, StepCostModel
from prefixkv.sim.tier import SimTierOptions, tiered
from prefixkv.stats import percentile, ratio, summarize

# The step-driven benchmarks' clock: a fixed part per step plus a part per batched token (times are secondary there).
TOY_COST = StepCostModel(
    name="toy",
    source="round numbers for step-driven workloads (10 ms per step, 0.2 ms per token); not a measurement",
    step_overhead_s=0.010,
    per_token_s=0.0002,
    per_attended_pair_s=0.0,
)
_FIRST_GENERATED_ID = 10_000_000  # generated ids never collide with prompt ids or each other


@dataclass
class SimRequest:
    """A step-driven workload's request: due at scheduler step `arrival_step`."""

    arrival_step: int
    prompt: list[int]
    output_len: int
    group: str = ""
    lora_id: str | None = None
    cache_salt: str | None = None


class TimedRequest(Protocol):
    """A trace request as the simulator needs it (traces.ScaledRequest is one): due at `arrival_s`, its prompt
    built only when it arrives."""

    arrival_s: float
    output_len: int
    prompt_len: int

    def prompt_tokens(self) -> list[int]: ...


@dataclass(slots=True)
class Arrival:
    """One request for the loop: due when the clock (seconds or steps) reaches `due`."""

    due: float
    request_id: str
    prompt_len: int
    output_len: int
    make_prompt: Callable[[], list[int]]
    group: str = ""
    lora_id: str | None = None
    cache_salt: str | None = None
    retention_seconds: float | None = None  # simulated seconds (kvcache/retention.py)
    retention_priority: int = 0
    session: SessionHint | None = None  # an agent session's hint (engine/agent_sessions.py)


@dataclass(slots=True)
class RequestMetrics:
    """What is kept of a request once it is finished or rejected (times in simulated seconds)."""

    request_id: str
    group: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # asked for
    hit_tokens: int = 0  # prefix-cache hit at first admission
    queue_s: float | None = None  # first admission - arrival
    ttft_s: float | None = None  # first token sampled - arrival
    latency_s: float | None = None  # last token sampled - arrival
    wait_steps: int | None = None  # first admission step - arrival step
    preemptions: int = 0
    rejected: bool = False  # prompt + output can never fit the pool (or max_model_len): never scheduled
    missed_by_cause: dict[str, int] = field(default_factory=dict)  # its first admission's CacheMiss, by cause


@dataclass
class SimResult:
    metrics: list[RequestMetrics] = field(default_factory=list)  # finished and rejected requests, in that order
    requests: list[Request] = field(default_factory=list)  # the Request objects, only with keep_requests
    groups: dict[str, str] = field(default_factory=dict)  # request_id -> group
    wait_steps: dict[str, int] = field(default_factory=dict)  # request_id -> first admission step - arrival step
    wait_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    sim_seconds: float = 0.0  # the clock at the end: the last finish (arrivals start at 0)
    computed_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    component_stats: dict = field(default_factory=dict)  # the step components' own figures (a tier's), at the end

    @property
    def rejected(self) -> list[RequestMetrics]:
        return [m for m in self.metrics if m.rejected]


class SessionHooks(Protocol):
    """What the engine tells its session pins (engine/agent_sessions.py SessionPins is one): a hinted request
    arrived, a request finished."""

    def on_add(self, request: Request) -> None: ...

    def on_finish(self, request: Request) -> None: ...


class SimClock:
    """Simulated time in seconds: the cost model's executor advances it; whatever reads time in a simulation
    (retention deadlines, the loop) is handed `now`."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds

    def now(self) -> float:
        return self.seconds


class CostModelExecutor:
    """The engine core's Executor in a simulation: no model. The step takes the cost model's time for its batch
    (an empty step: the step overhead), and each request whose sequence the step completes samples a fresh token
    id (ids never collide with prompt ids or each other)."""

    def __init__(self, cost: StepCostModel, clock: SimClock) -> None:
        self.cost, self.clock = cost, clock
        self._next_token = _FIRST_GENERATED_ID

    def execute(self, scheduled: SchedulerOutput) -> list[Sample | None]:
        self.clock.seconds += self.cost.step_time(BatchShape.of(scheduled.scheduled))
        samples: list[Sample | None] = []
        for request, n in scheduled.scheduled:
            if request.num_computed_tokens + n == request.num_tokens:
                samples.append(Sample(self._next_token))
                self._next_token += 1
            else:
                samples.append(None)
        return samples


class Simulation:
    """One run: a scheduler over `kv` with `policy`, a clock driven by `cost`, and the metrics of each request.

    clock="seconds": an arrival is due when the simulated time reaches it; an idle engine jumps to the next
    arrival. clock="steps": an arrival is due at a scheduler step; an idle engine runs empty steps (charged the
    step overhead) until it arrives, as the step-driven benchmarks always have."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        cost: StepCostModel,
        clock: str = "seconds",
        keep_requests: bool = False,
        check_every: int = 0,
        max_steps: int | None = None,
        on_done: Callable[[int], None] | None = None,
        sim_clock: SimClock | None = None,
        components: Iterable[StepComponent] = (),
        sessions: SessionHooks | None = None,
    ) -> None:
        """sim_clock: the simulated time (a new one at 0 by default); a KV manager whose requests ask for
        retention must have been built with clock=sim_clock.now. components: step components beside the
        scheduler and the cost model (engine/core.py), e.g. a probe of each step's schedule. sessions: the engine's
        session pins over `kv`, told of each hinted request as the engine tells them (arrival, finish)."""
        if clock not in ("seconds", "steps"):
            raise ValueError(f"clock must be 'seconds' or 'steps', got {clock!r}")
        self.kv = kv
        self.sim_clock = sim_clock or SimClock()
        self.scheduler = Scheduler(config, kv, policy)
        self.core = EngineCore(self.scheduler, CostModelExecutor(cost, self.sim_clock), list(components))
        self.cost = cost
        self.clock = clock
        self.keep_requests = keep_requests
        self.check_every = check_every
        self.max_steps = max_steps
        self.on_done = on_done  # called with 1 for each request finished or rejected (a progress bar)
        self.capacity = min(kv.num_pages * kv.page_size, config.max_model_len or kv.num_pages * kv.page_size)
        self.result = SimResult()
        self._live: dict[Request, RequestMetrics] = {}
        self.sessions = sessions

    def now(self) -> float:
        """The simulated time, in seconds (both clocks charge each step its cost)."""
        return self.sim_clock.seconds

    def wait_until(self, seconds: float) -> None:
        """An idle engine's clock jumps to `seconds` (an arrival), never back."""
        self.sim_clock.seconds = max(self.sim_clock.seconds, seconds)
        self.result.sim_seconds = self.sim_clock.seconds

    def run(self, arrivals: Iterable[Arrival]) -> SimResult:
        """Serve every arrival (in non-decreasing `due` order) to the end and return the result."""
        sched, res = self.scheduler, self.result
        pending: Iterator[Arrival] = iter(arrivals)
        upcoming = next(pending, None)
        empty_steps = 0
        while upcoming is not None or sched.has_work():
            now = res.sim_seconds if self.clock == "seconds" else sched.step_count
            while upcoming is not None and upcoming.due <= now:
                self.arrive(upcoming)
                upcoming = next(pending, None)
            if not sched.has_work():
                if upcoming is not None and self.clock == "seconds":
                    self.wait_until(upcoming.due)
                    continue
                if upcoming is None:
                    break
            if self.max_steps is not None and sched.step_count >= self.max_steps:
                raise RuntimeError(f"simulation did not finish in {self.max_steps} steps")
            scheduled = self.step()
            empty_steps = 0 if scheduled else empty_steps + 1
            if empty_steps > 10_000 and (upcoming is None or self.clock == "seconds"):
                raise RuntimeError(
                    f"no progress for {empty_steps} steps with {len(sched.waiting)} waiting and "
                    f"{len(sched.running)} running requests"
                )
        res.steps = sched.step_count
        res.preemptions = sched.num_preemptions
        res.component_stats = self.core.stats()
        return res

    def arrive(self, arrival: Arrival) -> None:
        """Queue `arrival` (or count it rejected when it can never fit); run() calls it when the clock reaches it,
        the multi-replica loop when its router has chosen this replica."""
        res = self.result
        arrival_s = arrival.due if self.clock == "seconds" else self.now()  # it may arrive mid-step
        metrics = RequestMetrics(arrival.request_id, arrival.group, arrival_s, arrival.prompt_len, arrival.output_len)
        res.groups[arrival.request_id] = arrival.group
        if arrival.prompt_len + arrival.output_len > self.capacity or arrival.output_len < 1:
            metrics.rejected = True  # the engine refuses it at add_request; here it is counted, not a hang
            res.metrics.append(metrics)
            if self.on_done:
                self.on_done(1)
            return
        request = Request(
            arrival.request_id,
            arrival.make_prompt(),
            RequestOptions(
                SamplingParams(max_tokens=arrival.output_len),
                cache_salt=arrival.cache_salt,
                lora_id=arrival.lora_id,
                retention=Retention(arrival.retention_seconds, arrival.retention_priority),
                session=arrival.session,
            ),
            arrival_time=arrival_s,
        )
        request.max_tokens = arrival.output_len
        if arrival.retention_seconds is not None and self.kv.retention.clock != self.sim_clock.now:
            raise ValueError(
                "a request asks for retention, but the KV manager's retention clock is not this simulation's: "
                "build it with clock=sim_clock.now (create_kv(config, sim_clock))"
            )
        if self.sessions is not None:
            self.sessions.on_add(request)
        self.core.add(request)
        self._live[request] = metrics
        if self.keep_requests:
            res.requests.append(request)

    def step(self) -> bool:
        """One step of the engine core, charged the cost model's time for its batch; False when nothing was
        scheduled."""
        sched, res = self.scheduler, self.result
        step, start_s = sched.step_count, self.now()
        result = self.core.step()
        res.sim_seconds = self.now()
        res.computed_tokens += result.scheduled.num_batched_tokens
        for request, _ in result.scheduled.scheduled:
            metrics = self._live[request]
            if metrics.queue_s is None:
                metrics.queue_s = start_s - metrics.arrival_s
                metrics.wait_steps = step - request.arrival_step
                res.wait_steps[request.request_id] = metrics.wait_steps
                res.wait_s[request.request_id] = metrics.queue_s
        for (request, _), sample in zip(result.scheduled.scheduled, result.samples, strict=True):
            if sample is None:
                continue
            res.output_tokens += 1
            metrics = self._live[request]
            if metrics.ttft_s is None:
                metrics.ttft_s = res.sim_seconds - metrics.arrival_s
            if request.num_output_tokens >= request.max_tokens:
                sched.finish(request, RequestStatus.FINISHED_LENGTH)
                if self.sessions is not None:
                    self.sessions.on_finish(request)
                self._finished(request, metrics)
        self.core.after_outputs()
        if self.check_every and step % self.check_every == 0:
            self.kv.check_invariants()
        return bool(result.scheduled.scheduled)

    def _finished(self, request: Request, metrics: RequestMetrics) -> None:
        """Keep the metrics, drop the request (its tokens are the memory a long trace cannot afford to keep)."""
        del self._live[request]
        metrics.latency_s = self.result.sim_seconds - metrics.arrival_s
        metrics.hit_tokens = max(request.num_cached_tokens, 0)
        if request.cache_miss is not None:
            metrics.missed_by_cause = request.cache_miss.tokens_by_cause
        metrics.preemptions = request.num_preemptions
        self.result.metrics.append(metrics)
        if self.on_done:
            self.on_done(1)


def make_policy(name: SchedulePolicy, max_wait_steps: int = 128) -> SchedulingPolicy:
    return create_policy(EngineConfig(schedule_policy=name, lpm_fallback_threshold=None, max_wait_steps=max_wait_steps))


def create_kv(config: EngineConfig, clock: SimClock) -> KVCacheManager:
    """The KV manager `config` names, with a pool of config.kv_cache_tokens (the simulator has no bytes per token),
    its retention deadlines on `clock`."""
    if config.kv_cache_tokens is None:
        raise ValueError("the simulator needs kv_cache_tokens (a pool size in tokens)")
    num_pages = config.kv_cache_pages(bytes_per_token=1)
    return create_kv_cache_manager(
        config.prefix_cache,
        num_pages,
        config.tokens_per_page,
        config.prefix_caching_hash_algo,
        config.eviction,
        config.retained_pool_fraction,
        clock=clock.now,
        miss_history=-1,  # every eviction remembered: the breakdown of misses by cause is exact
    )


def simulate(
    kv: KVCacheManager,
    policy: SchedulingPolicy,
    workload: list[SimRequest],
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 2048,
    cost: StepCostModel | None = None,
    max_steps: int = 100_000,
    check_every: int = 0,
) -> SimResult:
    """Step-driven: each request arrives at its scheduler step. The Request objects are kept in the result
    (small workloads whose tests read them)."""
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sim = Simulation(
        config,
        kv,
        policy,
        cost or TOY_COST,
        clock="steps",
        keep_requests=True,
        check_every=check_every,
        max_steps=max_steps,
    )
    ordered = sorted(workload, key=lambda r: r.arrival_step)
    arrivals = (
        Arrival(
            s.arrival_step,
            f"{s.group}{i}",
            len(s.prompt),
            s.output_len,
            s.prompt.copy,
            s.group,
            s.lora_id,
            s.cache_salt,
        )
        for i, s in enumerate(ordered)
    )
    return sim.run(arrivals)


@dataclass(frozen=True)
class Tenancy:
    """What a trace does not say and a run may add: `tenants` > 1 gives each conversation one of that many cache
    salts, and retention_seconds retains pages that long (simulated seconds), for the conversations
    `retention_share` of them (all by default; a share models clients that mark breakpoints beside ones that do
    not). Both make misses of their own (isolated, expired) to study.

    A conversation is the trace's session where it has one; else the requests that share their first two blocks
    (a system prompt many requests share, then the conversation's first turn, which each later turn resends:
    Mooncake's conversation trace); else each request alone."""

    tenants: int = 1
    retention_seconds: float | None = None
    retention_share: float = 1.0

    def __post_init__(self) -> None:
        if self.tenants < 1:
            raise ValueError(f"--tenants must be >= 1, got {self.tenants}")
        Retention(self.retention_seconds)  # a ValueError naming the field when it is bad
        if not 0 < self.retention_share <= 1:
            raise ValueError(f"--retention-share must be in (0, 1], got {self.retention_share}")
        if self.retention_share < 1 and not self.retention_seconds:
            raise ValueError("--retention-share needs --retention-seconds (a share of no retention)")

    def salt(self, conversation: str) -> str | None:
        return f"tenant-{zlib.crc32(conversation.encode()) % self.tenants}" if self.tenants > 1 else None

    def retention(self, conversation: str) -> float | None:
        """The conversation's retention: the share is taken by a hash of its key, apart from the tenant's."""
        if self.retention_share < 1 and zlib.crc32(b"retain:" + conversation.encode()) % 10_000 >= (
            self.retention_share * 10_000
        ):
            return None
        return self.retention_seconds


NO_TENANCY = Tenancy()


def conversation_key(request: TimedRequest, index: int) -> str:
    """Which conversation a trace request belongs to (see Tenancy)."""
    session = getattr(request, "session", None)
    if session:
        return session
    blocks: tuple[int, ...] = getattr(request, "block_ids", ())
    return f"blocks:{blocks[0]}-{blocks[1]}" if len(blocks) >= 2 else f"request:{index}"


def trace_arrivals(requests: Iterable[TimedRequest], tenancy: Tenancy = NO_TENANCY) -> Iterator[Arrival]:
    for i, r in enumerate(requests):
        session = getattr(r, "session", None)
        conversation = conversation_key(r, i)
        yield Arrival(
            r.arrival_s,
            f"r{i}",
            r.prompt_len,
            r.output_len,
            r.prompt_tokens,
            session or "",
            cache_salt=tenancy.salt(conversation),
            retention_seconds=tenancy.retention(conversation),
        )


def simulate_trace(
    config: EngineConfig,
    requests: Iterable[TimedRequest],
    cost: StepCostModel,
    on_done: Callable[[int], None] | None = None,
    check_every: int = 0,
    tenancy: Tenancy = NO_TENANCY,
    tier: SimTierOptions | None = None,
) -> tuple[SimResult, KVCacheManager]:
    """Time-driven: the KV manager, policy and scheduler `config` names serve `requests` (in arrival order) at
    their arrival times, with a simulated second tier behind the pool if `tier` is given; returns the result and
    the KV manager (its stats: hits, evictions)."""
    clock = SimClock()
    kv = create_kv(config, clock)
    components = []
    if tier is not None:

        def advance(seconds: float) -> None:
            clock.seconds += seconds

        kv, copier = tiered(kv, tier, config.prefix_caching_hash_algo, clock.now, advance)
        components.append(copier)
    sim = Simulation(
        config,
        kv,
        create_policy(config),
        cost,
        clock="seconds",
        check_every=check_every,
        on_done=on_done,
        sim_clock=clock,
        components=components,
    )
    return sim.run(trace_arrivals(requests, tenancy)), kv


def _latency(values: list[float]) -> dict:
    return {
        "n": len(values),
        "mean": ratio(sum(values), len(values)),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values, default=float("nan")),
    }


def summarize_trace(res: SimResult, kv: KVCacheManager) -> dict:
    """A time-driven run in figures: hit rate over the served requests' prompts, TTFT and queueing percentiles
    (simulated seconds), throughput over the simulated span, evictions, preemptions, rejections."""
    served = [m for m in res.metrics if not m.rejected]
    prompt = sum(m.prompt_tokens for m in served)
    hit = sum(m.hit_tokens for m in served)
    return {
        "requests": len(res.metrics),
        "served_requests": len(served),
        "rejected_requests": len(res.metrics) - len(served),
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "token_hit_rate": ratio(hit, prompt),
        "output_tokens": res.output_tokens,
        "computed_tokens": res.computed_tokens,
        "sim_seconds": res.sim_seconds,
        "output_tok_s": ratio(res.output_tokens, res.sim_seconds),
        "requests_per_s": ratio(len(served), res.sim_seconds),
        "ttft_s": _latency([m.ttft_s for m in served if m.ttft_s is not None]),
        "queue_s": _latency([m.queue_s for m in served if m.queue_s is not None]),
        "latency_s": _latency([m.latency_s for m in served if m.latency_s is not None]),
        "steps": res.steps,
        "preemptions": res.preemptions,
        "evicted_pages": kv.stats.evicted_pages,
        "missed_tokens_by_cause": missed_by_cause([kv]),
        "readmission_hit_tokens": kv.stats.readmission_hits,
        "pool_pages": kv.num_pages,
        "page_size": kv.page_size,
        **res.component_stats,
    }


def missed_by_cause(kvs: Sequence[KVCacheManager]) -> dict[str, int]:
    """Missed prompt tokens of first admissions by cause (cache_miss.py), over `kvs` (one per replica); every
    cause listed. They sum to the served prompt tokens minus their hits."""
    out = dict.fromkeys(CAUSES, 0)
    for kv in kvs:
        for cause, tokens in kv.stats.missed_by_cause.items():
            out[cause] += tokens
    return out


def summarize_run(res: SimResult, kv: KVCacheManager) -> dict:
    """Hit rate over first admissions (what the offline bound is about), waits, simulated throughput."""
    prompt = sum(r.num_prompt_tokens for r in res.requests)
    hit = sum(max(r.num_cached_tokens, 0) for r in res.requests)
    waits = list(res.wait_steps.values())
    per_group: dict[str, list[int]] = {}
    for rid, w in res.wait_steps.items():
        per_group.setdefault(res.groups[rid], []).append(w)
    return {
        "token_hit_rate": ratio(hit, prompt),
        "hit_tokens": hit,
        "prompt_tokens": prompt,
        "cache_hit_rate": kv.stats.hit_rate,  # the cache's own gauge: first admissions, the same figure
        "readmission_hit_tokens": kv.stats.readmission_hits,  # preempted requests finding their pages again
        "readmission_tokens": kv.stats.readmission_queries,
        "computed_tokens": res.computed_tokens,
        "output_tokens": res.output_tokens,
        "steps": res.steps,
        "sim_seconds": res.sim_seconds,
        "sim_output_tok_s": ratio(res.output_tokens, res.sim_seconds),
        "sim_requests_per_s": ratio(len(res.requests), res.sim_seconds),
        "preemptions": res.preemptions,
        "wait_steps": summarize(waits),
        "wait_s": summarize(list(res.wait_s.values())),
        "p99_wait_steps": percentile(waits, 99),
        "max_wait_steps": max(waits, default=0),
        "mean_wait_steps_by_group": {g: sum(ws) / len(ws) for g, ws in sorted(per_group.items())},
    }
