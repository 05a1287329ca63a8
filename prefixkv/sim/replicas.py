"""N engine replicas behind the router library, on one simulated clock.

Each replica is a Simulation (the real Scheduler and KV manager, its own cost-model clock): it steps whenever it
has work and its clock is the earliest, so replicas run in parallel in simulated time. An arrival is routed when
the shared clock reaches it, on the replicas' states at that moment (each busy replica's state is the one after
the step it has begun, at most one step ahead). With the precise policy, each replica's KV events are drained
after every step and fed to the router's index, as the replicas' event streams would be.

"pooled" is the bound the routers are measured against: one engine with the N replicas' pool, batch limits and
compute together (its cost model's times divided by N), so no prefix is ever on the wrong replica.

With a shared tier (sim/shared_tier.py) every replica's pool sits behind the engine's tiered cache over one
shared store: what one replica computed, another loads. The precise router then also hears the store's events
(medium "REMOTE") due by each arrival, before routing it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prefixkv.config import EngineConfig
from prefixkv.engine.policy_factory import create_policy as create_schedule_policy
from prefixkv.kvcache.manager import KVCacheManager, PagedKVCache
from prefixkv.kvcache.offload.tiered_cache import TieredKVCache
from prefixkv.router import ReplicaState, Router, RouteRequest, policy_options
from prefixkv.router import create_policy as create_routing_policy
from prefixkv.sim.cost_model import StepCostModel
from prefixkv.sim.shared_tier import SHARED_STORE_PUBLISHER, SharedStore, remote_block_weight
from prefixkv.sim.simulator import (
    NO_TENANCY,
    Arrival,
    SimClock,
    SimResult,
    Simulation,
    Tenancy,
    TimedRequest,
    create_kv,
    missed_by_cause,
    summarize_trace,
    trace_arrivals,
)
from prefixkv.sim.tier import SimTierCopier, SimTierOptions, tiered

POOLED = "pooled"
ROUTERS = ("round-robin", "least-loaded", "power-of-two", "approximate", "precise", POOLED)
_MAX_IDLE_STEPS = 10_000  # steps of one replica scheduling nothing while it has work: a livelock, not a load


@dataclass
class ReplicaSetResult:
    """Every replica's result and KV manager, and how many requests the router sent to each (with a shared tier:
    each replica's copier and the store)."""

    results: list[SimResult]
    kvs: list[KVCacheManager]
    routed: list[int]
    router: Router
    copiers: list[SimTierCopier] = dataclasses.field(default_factory=list)
    store: SharedStore | None = None
    busy_s: list[float] = dataclasses.field(default_factory=list)  # per replica, simulated seconds spent in steps

    def merged(self) -> SimResult:
        """One SimResult over all replicas (the simulated span is the last replica's finish)."""
        out = SimResult()
        for res in self.results:
            out.metrics += res.metrics
            out.steps += res.steps
            out.computed_tokens += res.computed_tokens
            out.output_tokens += res.output_tokens
            out.preemptions += res.preemptions
            out.sim_seconds = max(out.sim_seconds, res.sim_seconds)
        return out


def replica_state(replica_id: str, sim: Simulation) -> ReplicaState:
    """The load gauges a server would expose, read off the replica's scheduler and KV manager."""
    sched, kv = sim.scheduler, sim.kv
    pending = sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.waiting)
    pending += sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in sched.running)
    used = kv.num_used_pages()
    return ReplicaState(
        replica_id,
        waiting=len(sched.waiting),
        running=len(sched.running),
        kv_usage=used / kv.num_pages,
        pending_prefill_tokens=pending,
        active_blocks=used,
    )


def pooled_config(config: EngineConfig, cost: StepCostModel, num_replicas: int) -> tuple[EngineConfig, StepCostModel]:
    """One engine as big as `num_replicas` replicas: their pool, batch limits and compute together."""
    assert config.kv_cache_tokens is not None
    big = dataclasses.replace(
        config,
        kv_cache_tokens=config.kv_cache_tokens * num_replicas,
        max_num_seqs=config.max_num_seqs * num_replicas,
        max_num_batched_tokens=config.max_num_batched_tokens * num_replicas,
    )
    fast = dataclasses.replace(
        cost,
        name=f"{cost.name} / {num_replicas}",
        step_overhead_s=cost.step_overhead_s / num_replicas,
        per_token_s=cost.per_token_s / num_replicas,
        per_attended_pair_s=cost.per_attended_pair_s / num_replicas,
        per_sequence_s=cost.per_sequence_s / num_replicas,
        per_decode_pair_s=None if cost.per_decode_pair_s is None else cost.per_decode_pair_s / num_replicas,
    )
    return big, fast


def simulate_replicas(
    config: EngineConfig,
    requests: Iterable[TimedRequest],
    cost: StepCostModel,
    num_replicas: int,
    router: str,
    router_options: dict | None = None,
    on_done: Callable[[int], None] | None = None,
    tenancy: Tenancy = NO_TENANCY,
    shared_tier: SimTierOptions | None = None,
) -> ReplicaSetResult:
    """Serve `requests` (in arrival order) with `num_replicas` replicas, each configured by `config` (its pool is
    one replica's), behind the routing policy `router` (or the pooled bound), with `shared_tier` (one store of
    that size and cost) behind every replica's pool if given. The precise router's remote_block_weight defaults
    to what the shared tier's cost and `cost` say (shared_tier.remote_block_weight)."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
    if router == POOLED:
        config, cost = pooled_config(config, cost, num_replicas)
        num_replicas = 1
    name = "round-robin" if router == POOLED else router
    options: dict = {"block_size": config.tokens_per_page, "hash_algo": config.prefix_caching_hash_algo}
    if shared_tier is not None and "remote_block_weight" in policy_options(name):
        options["remote_block_weight"] = remote_block_weight(cost, shared_tier.cost, shared_tier.chunk_tokens)
    options = {k: v for k, v in options.items() if k in policy_options(name)} | (router_options or {})
    policy = create_routing_policy(name, **options)
    listens = router == "precise"
    store = None
    if shared_tier is not None:
        store = SharedStore(shared_tier.capacity_tokens, shared_tier.chunk_tokens, publish=listens)
    sims, copiers, ids = [], [], [f"replica-{i}" for i in range(num_replicas)]
    for _ in range(num_replicas):
        clock = SimClock()  # each replica's own: a busy one runs ahead of an idle one until the next arrival
        kv = create_kv(config, clock)
        if listens:
            kv.enable_events()
        components = []
        if shared_tier is not None:
            kv, copier = tiered(kv, shared_tier, config.prefix_caching_hash_algo, clock.now, _advancer(clock), store)
            components.append(copier)
            copiers.append(copier)
        schedule_policy = create_schedule_policy(config)
        sims.append(
            Simulation(
                config,
                kv,
                schedule_policy,
                cost,
                clock="seconds",
                on_done=on_done,
                sim_clock=clock,
                components=components,
            )
        )
    _tell_where_pages_are([s.kv for s in sims])
    loop = _Loop(Router(policy), ids, sims, listens, store)
    loop.run(trace_arrivals(requests, tenancy))
    for sim in sims:
        sim.result.steps = sim.scheduler.step_count
        sim.result.preemptions = sim.scheduler.num_preemptions
        sim.result.component_stats = sim.core.stats()
    results, kvs = [s.result for s in sims], [s.kv for s in sims]
    return ReplicaSetResult(results, kvs, loop.routed, loop.router, copiers, store, loop.busy_s)


def _advancer(clock: SimClock) -> Callable[[float], None]:
    """What the tier's copier calls to charge a step its reads: the replica's clock moves on by that much."""

    def advance(seconds: float) -> None:
        clock.seconds += seconds

    return advance


def _tell_where_pages_are(kvs: list[KVCacheManager]) -> None:
    """Each replica's miss listener learns which pages the others hold: a page missed here but held there was
    the router's to find (cache_miss.py: routed)."""
    pools = [kv.inner if isinstance(kv, TieredKVCache) else kv for kv in kvs]
    listeners = [kv.misses for kv in pools if isinstance(kv, PagedKVCache)]
    if len(listeners) < 2:
        return
    for me in listeners:
        others = [other for other in listeners if other is not me]
        me.elsewhere = lambda key, others=others: any(other.holds(key) for other in others)


class _Loop:
    """The shared clock: the next thing to happen is the earliest of the next arrival and the busy replicas'
    next steps (an arrival at the same instant as a step goes first, as in the one-replica loop)."""

    def __init__(
        self, router: Router, ids: list[str], sims: list[Simulation], listens: bool, store: SharedStore | None = None
    ) -> None:
        self.router, self.ids, self.sims, self.listens = router, ids, sims, listens
        self.store = store if listens else None  # whose events the router hears before each routing
        self.routed = [0] * len(sims)
        self.busy_s = [0.0] * len(sims)
        self._idle_steps = [0] * len(sims)
        self._in_flight: dict[str, RouteRequest] = {}  # request id -> what was routed, until it finishes
        self._reported = [0] * len(sims)  # per replica, how many of its finished requests the router heard of

    def run(self, arrivals: Iterable[Arrival]) -> None:
        pending: Iterator[Arrival] = iter(arrivals)
        upcoming = next(pending, None)
        while True:
            busy = [(s.now(), i) for i, s in enumerate(self.sims) if s.scheduler.has_work()]
            next_step = min(busy) if busy else None
            if upcoming is not None and (next_step is None or upcoming.due <= next_step[0]):
                self._route(upcoming)
                upcoming = next(pending, None)
            elif next_step is not None:
                self._step(next_step[1])
            else:
                return

    def _route(self, arrival: Arrival) -> None:
        if self.store is not None:
            self.router.kv_events(SHARED_STORE_PUBLISHER, self.store.drain_events(arrival.due))
        tokens = arrival.make_prompt()
        request = RouteRequest(tokens, arrival.lora_id, arrival.cache_salt, request_id=arrival.request_id)
        states = [replica_state(rid, sim) for rid, sim in zip(self.ids, self.sims, strict=True)]
        i = self.ids.index(self.router.route(request, states))
        sim = self.sims[i]
        if not sim.scheduler.has_work():  # an idle replica's clock waited at its last finish: bring it to now
            sim.wait_until(arrival.due)
        sim.arrive(dataclasses.replace(arrival, make_prompt=lambda: tokens))
        self.routed[i] += 1
        self._in_flight[arrival.request_id] = request
        self._report_finished(i)  # a request that can never fit is finished (rejected) on arrival

    def _step(self, i: int) -> None:
        sim = self.sims[i]
        started = sim.now()
        scheduled = sim.step()
        self.busy_s[i] += sim.now() - started
        self._idle_steps[i] = 0 if scheduled else self._idle_steps[i] + 1
        if self._idle_steps[i] > _MAX_IDLE_STEPS:
            sched = sim.scheduler
            raise RuntimeError(
                f"{self.ids[i]}: no progress for {self._idle_steps[i]} steps with {len(sched.waiting)} waiting and "
                f"{len(sched.running)} running requests"
            )
        if self.listens:
            self.router.kv_events(self.ids[i], sim.kv.drain_events())
        self._report_finished(i)

    def _report_finished(self, i: int) -> None:
        """Tell the router about the requests replica i finished (or rejected) since the last report."""
        metrics = self.sims[i].result.metrics
        for m in metrics[self._reported[i] :]:
            self.router.finished(self._in_flight.pop(m.request_id), self.ids[i])
        self._reported[i] = len(metrics)


def summarize_replicas(fleet: ReplicaSetResult) -> dict:
    """summarize_trace's figures over all replicas together, and how the router spread the requests."""
    summary = summarize_trace(fleet.merged(), fleet.kvs[0])
    summary["evicted_pages"] = sum(kv.stats.evicted_pages for kv in fleet.kvs)
    summary["missed_tokens_by_cause"] = missed_by_cause(fleet.kvs)
    summary["readmission_hit_tokens"] = sum(kv.stats.readmission_hits for kv in fleet.kvs)
    summary["pool_pages"] = sum(kv.num_pages for kv in fleet.kvs)
    summary["routed_per_replica"] = fleet.routed
    # load, three ways, each the busiest replica over the mean: the time each spent in steps (what it computed and
    # loaded), the requests it was sent, and the requests in flight there (ReplicaState.load) averaged over the
    # run: a request counts from its arrival to its last token, so that mean is its latencies' sum over the span
    summary["busy_s_per_replica"] = fleet.busy_s
    summary["busy_max_over_mean"] = max_over_mean(fleet.busy_s)
    summary["routed_max_over_mean"] = max_over_mean(fleet.routed)
    span = max((res.sim_seconds for res in fleet.results), default=0.0)
    in_flight = [sum(m.latency_s or 0.0 for m in res.metrics) / span if span else 0.0 for res in fleet.results]
    summary["in_flight_per_replica"] = in_flight
    summary["in_flight_max_over_mean"] = max_over_mean(in_flight)
    computed = [res.computed_tokens for res in fleet.results]
    summary["computed_tokens_per_replica"] = computed
    summary["computed_max_over_mean"] = max_over_mean(computed)
    if fleet.store is not None:
        summary.update(shared_tier_summary(fleet))
    return summary


def max_over_mean(values: list[int] | list[float]) -> float | None:
    """The busiest replica's share over the mean (1.0: perfectly even); None when there is nothing to share."""
    total = sum(values)
    return max(values) * len(values) / total if total else None


def shared_tier_summary(fleet: ReplicaSetResult) -> dict:
    """What the shared store did, from the replicas' tiered caches and SimTiers and from the store itself."""
    assert fleet.store is not None
    caches = [c.cache.tier_stats for c in fleet.copiers]
    tiers = [c.tier for c in fleet.copiers]
    return {
        "shared_tier_capacity_tokens": fleet.store.capacity_tokens,
        "shared_tier_cost": tiers[0].cost.name,
        "shared_tier_hit_tokens": sum(s.hit_tokens for s in caches),
        "shared_tier_hit_tokens_per_replica": [s.hit_tokens for s in caches],
        "shared_tier_loaded_chunks": sum(s.loaded_chunks for s in caches),
        "shared_tier_saved_chunks": sum(s.saved_chunks for s in caches),
        "shared_tier_stored_chunks": sum(t.stats.entries for t in tiers),
        "shared_tier_held_chunks": fleet.store.stats.entries,
        "shared_tier_evicted_chunks": fleet.store.stats.evicted,
        "shared_tier_dropped_saves": sum(t.dropped_writes for t in tiers),
        "shared_tier_read_ahead_chunks": sum(t.read_ahead_chunks for t in tiers),
        "shared_tier_probes": sum(t.probes for t in tiers),
        "shared_tier_stall_s": sum(c.stall_s for c in fleet.copiers),
    }
