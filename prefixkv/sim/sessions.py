"""Agent sessions replayed closed loop through the simulator, under session-aware cache policies.

A session's next request is issued its think time after the previous answer (a slow engine slows the session, as
in reality); a group of subagents starts at the recorded offsets and the parent resumes after the last of them.
The engine is the simulator's (simulator.Simulation: the real scheduler and KV cache on a simulated clock); this
module only decides when requests arrive and what the cache is told between them.

The policies are the engine's own (engine/agent_sessions.py: SessionPins, the same code `prefixkv serve` runs on
session hints): each request carries the hint an agent framework would send (session id, parent, the pause after
its answer, release at the agent's last request), and the simulation's engine pins as the real one does. `lru` is
the engine's `none` (hints ignored: today's behaviour).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixkv.config import EngineConfig
from prefixkv.engine.agent_sessions import SessionPins
from prefixkv.engine.policy_factory import create_policy
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request
from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams
from prefixkv.session_hint import SessionHint
from prefixkv.sim.agent_traces import (
    AgentPrompt,
    AgentRequest,
    AgentScaling,
    AgentSession,
    SubagentGroup,
    scaled_prompt,
)
from prefixkv.sim.cost_model import StepCostModel
from prefixkv.sim.simulator import Arrival, SimClock, Simulation, create_kv, missed_by_cause
from prefixkv.sim.tier import SimTierCopier, SimTierOptions, tiered
from prefixkv.sim.traces import BlockTokens
from prefixkv.stats import percentile, ratio

POLICIES = ("lru", "ttl", "pause", "session")  # lru: the engine's session policy "none"
# with a second tier, a policy may add: demote (the turn's sequence goes to the tier when its pause starts) and
# prefetch (the tier's chunks of the sequence are read back to be ready when the announced pause ends)
TIER_ACTIONS = ("demote", "prefetch")


@dataclass(frozen=True)
class SessionPolicy:
    """A pool policy, and the tier actions after a '+' (e.g. "session+prefetch", "lru+demote+prefetch")."""

    name: str = "lru"
    pin_seconds: float = 300.0  # ttl: Anthropic's default cache lifetime (5 minutes)
    grace: float = 1.25  # pause: the pin lasts the announced pause x grace + 1 s (an estimate may run late)

    def __post_init__(self) -> None:
        pins, *actions = self.name.split("+")
        if pins not in POLICIES:
            raise ValueError(f"unknown session policy {pins!r} (known: {', '.join(POLICIES)})")
        unknown = [a for a in actions if a not in TIER_ACTIONS]
        if unknown or len(set(actions)) != len(actions):
            raise ValueError(
                f"session policy {self.name!r}: after '+' only {' and '.join(TIER_ACTIONS)}, each at most once"
            )
        if not (math.isfinite(self.pin_seconds) and self.pin_seconds > 0):
            raise ValueError(f"pin_seconds must be > 0, got {self.pin_seconds}")
        if not (math.isfinite(self.grace) and self.grace >= 1):
            raise ValueError(f"grace must be >= 1, got {self.grace}")

    @property
    def pins(self) -> str:
        """The engine's session policy (engine/agent_sessions.py) this one runs."""
        pins = self.name.split("+")[0]
        return "none" if pins == "lru" else pins

    @property
    def acts_on_tier(self) -> bool:
        return "+" in self.name

    @property
    def demote(self) -> bool:
        return "demote" in self.name.split("+")[1:]

    @property
    def prefetch(self) -> bool:
        return "prefetch" in self.name.split("+")[1:]


def step_hint(
    session: AgentSession, index: int, hint_id: str, parent_id: str | None, scaling: AgentScaling
) -> SessionHint:
    """The hint an agent framework would send with the request at step `index` of `session`: the pause before its
    next step (the next think time, or the subagents' recorded span) and release on its last step."""
    pause: float | None = None
    if index + 1 < len(session.steps):
        nxt = session.steps[index + 1]
        if isinstance(nxt, AgentRequest):
            pause = scaling.pause(nxt.think_s)
        else:
            spans = (scaling.pause(d) + a.recorded_s for d, a in zip(nxt.delays_s, nxt.agents, strict=True))
            pause = max(spans) + scaling.pause(nxt.resume_s)
    return SessionHint(hint_id, parent_id, pause, "keep" if pause is not None else "release")


@dataclass
class _Agent:
    """One agent's progress through its steps (a session or a subagent)."""

    session: AgentSession
    root: _Session
    parent: _Agent | None
    step: int = 0
    base_s: float = 0.0  # when its next step's wait began (its last answer, its subagents' join, its start)
    waiting_for: int = 0  # subagents still running
    joined_s: float = 0.0  # the latest subagent end of the group it waits for
    hint_id: str = ""  # its session id in the hints: unique per drawn session (a session may be drawn twice)
    joined: bool = False  # its subagents just joined: the recorded resume gap replaces the next think time


@dataclass
class _Session:
    id: str
    start_s: float
    end_s: float | None = None
    requests: int = 0
    rejected: int = 0
    rejected_steps: list[str] = field(default_factory=list)  # "agent id:step index" of each rejected request
    prompt_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Answered:
    """One request of the replay, as it went: which agent, when it arrived and was answered (simulated s)."""

    agent: str
    arrival_s: float
    answer_s: float
    prompt_tokens: int
    hit_tokens: int
    rejected: bool


@dataclass
class SessionResult:
    sessions: list[_Session]
    # the requests served (not rejected), in arrival order: the bounds' access sequence, over the same prompts
    # as the hit rate
    served: list[AgentPrompt] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    answered: list[Answered] = field(default_factory=list)  # in the order they were answered


class SessionReplay:
    """Sessions through one simulated engine; `run` returns per-session job completion times and the cache's
    figures."""

    def __init__(
        self,
        config: EngineConfig,
        cost: StepCostModel,
        scaling: AgentScaling,
        mapping: BlockTokens,
        policy: SessionPolicy,
        check_every: int = 0,
        tier: SimTierOptions | None = None,
    ) -> None:
        """tier: a second KV tier behind the pool (sim/tier.py); a policy with tier actions needs one."""
        if tier is None and (policy.demote or policy.prefetch):
            raise ValueError(f"session policy {policy.name!r} acts on a second tier: give the run one")
        self.config, self.scaling, self.mapping, self.policy = config, scaling, mapping, policy
        self.request_overhead_s = cost.request_overhead_s()  # StepCostModel.served(): HTTP and hand-off per request
        self.clock = SimClock()
        self.kv: KVCacheManager = create_kv(config, self.clock)
        self.copier: SimTierCopier | None = None
        components = []
        if tier is not None:
            self.kv, self.copier = tiered(self.kv, tier, config.prefix_caching_hash_algo, self.clock.now, self._advance)
            components.append(self.copier)
        self.pins = SessionPins(
            self.kv, policy.pins, ttl_seconds=policy.pin_seconds, grace=policy.grace, demote=policy.demote
        )
        self.sim = Simulation(
            config,
            self.kv,
            create_policy(config),
            cost,
            clock="seconds",
            check_every=check_every,
            sim_clock=self.clock,
            components=components,
            sessions=self,
        )
        self._sequences: dict[str, Request] = {}  # request id -> the finished request, until its agent moves on
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._by_request: dict[str, _Agent] = {}
        self._ids = itertools.count()
        self._seen_metrics = 0
        self._arrived: list[tuple[str, AgentPrompt]] = []  # (request id, prompt) in arrival order
        self._rejected: set[str] = set()
        self.answered: list[Answered] = []

    # -- the engine's session hooks (Simulation calls them): the pins, and what the tier actions need ----------
    def on_add(self, request: Request) -> None:
        self.pins.on_add(request)

    def on_finish(self, request: Request) -> None:
        self.pins.on_finish(request)
        if self.policy.prefetch:
            self._sequences[request.request_id] = request

    def _advance(self, seconds: float) -> None:
        self.clock.seconds += seconds

    def _prefetch_before(self, request: Request, due_s: float) -> None:
        """Read the sequence's chunks back from the tier so that they are ready at `due_s` (the announced end
        of the pause): start as late as reading all of it from the tier allows."""
        lead = self.copier.tier.cost.read_s(len(request.token_ids)) if self.copier is not None else 0.0
        self._at(max(self.sim.now(), due_s - lead), functools.partial(self._read_ahead, request))

    def _read_ahead(self, request: Request) -> None:
        assert self.copier is not None
        probe = Request(
            f"prefetch-{request.request_id}",
            list(request.token_ids),
            RequestOptions(SamplingParams(max_tokens=1), cache_salt=request.cache_salt, lora_id=request.lora_id),
        )
        try:
            self.copier.read_ahead(probe)
        finally:
            self.kv.free(probe)

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self, sessions: list[AgentSession], starts: list[float]) -> SessionResult:
        if len(sessions) != len(starts):
            raise ValueError("one start time per session")
        runs = []
        for k, (session, start) in enumerate(zip(sessions, starts, strict=True)):
            run = _Session(f"{k}:{session.id}", start)
            runs.append(run)
            agent = _Agent(session, run, None, base_s=start, hint_id=run.id)
            self._at(start, functools.partial(self._next_step, agent))
        sim, sched = self.sim, self.sim.scheduler
        while self._events or sched.has_work():
            while self._events and self._events[0][0] <= sim.now():
                _, _, action = heapq.heappop(self._events)
                action()
                self._answers()  # a rejected request is answered at once
            if not sched.has_work():
                if self._events:
                    sim.wait_until(self._events[0][0])
                continue
            sim.step()
            self._answers()
        if any(run.end_s is None for run in runs):
            raise RuntimeError("a session did not finish (a subagent join was lost)")
        served = [prompt for rid, prompt in self._arrived if rid not in self._rejected]
        return SessionResult(runs, served, self._summary(runs), self.answered)

    def _at(self, due: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (due, next(self._seq), action))

    def _answers(self) -> None:
        """Every request finished (or rejected) since the last call moves its agent on."""
        metrics = self.sim.result.metrics
        while self._seen_metrics < len(metrics):
            m = metrics[self._seen_metrics]
            self._seen_metrics += 1
            agent = self._by_request.pop(m.request_id)
            finished = self._sequences.pop(m.request_id, None)
            if finished is not None and finished.session is not None:
                pause = finished.session.expected_pause_s
                if pause is not None:
                    self._prefetch_before(finished, self.sim.now() + pause)
            run = agent.root
            run.requests += 1
            if m.rejected:
                run.rejected += 1
                run.rejected_steps.append(f"{agent.session.id}:{agent.step}")
                self._rejected.add(m.request_id)
            else:
                run.prompt_tokens += m.prompt_tokens
                run.hit_tokens += m.hit_tokens
            now = self.sim.now()
            self.answered.append(
                Answered(agent.session.id, m.arrival_s, now, m.prompt_tokens, m.hit_tokens, m.rejected)
            )
            self._answered(agent, now)

    # -- an agent's steps --------------------------------------------------------------------------------------
    def _next_step(self, agent: _Agent) -> None:
        """Start the agent's current step: issue its request after the think time, or start its subagents."""
        if agent.step >= len(agent.session.steps):
            self._ended(agent, agent.base_s)
            return
        step = agent.session.steps[agent.step]
        if isinstance(step, AgentRequest):
            due = agent.base_s + (0.0 if agent.joined else self.scaling.pause(step.think_s))
            due += self.request_overhead_s  # a served replay's request reaches the engine late (the engine alone: 0)
            agent.joined = False
            self._at(due, lambda: self._issue(agent, step, due))
            return
        agent.waiting_for = len(step.agents)
        agent.joined_s = agent.base_s
        for delay, sub in zip(step.delays_s, step.agents, strict=True):
            child = _Agent(
                sub,
                agent.root,
                agent,
                base_s=agent.base_s + self.scaling.pause(delay),
                hint_id=f"{agent.hint_id}/{sub.id}",
            )
            self._at(child.base_s, functools.partial(self._next_step, child))

    def _issue(self, agent: _Agent, step: AgentRequest, due: float) -> None:
        prompt = scaled_prompt(step, self.scaling, self.mapping)
        parent = agent.parent.hint_id if agent.parent is not None else None
        hint = step_hint(agent.session, agent.step, agent.hint_id, parent, self.scaling)
        request_id = f"s{next(self._ids)}"
        self._by_request[request_id] = agent
        self._arrived.append((request_id, prompt))
        arrival = Arrival(due, request_id, prompt.prompt_len, self.scaling.output_len(step), prompt.prompt_tokens)
        arrival.group, arrival.session = agent.root.id, hint
        self.sim.arrive(arrival)

    def _answered(self, agent: _Agent, now: float) -> None:
        agent.step += 1
        agent.base_s = now
        self._next_step(agent)

    def _ended(self, agent: _Agent, now: float) -> None:
        parent = agent.parent
        if parent is None:
            agent.root.end_s = now
            return
        parent.waiting_for -= 1
        parent.joined_s = max(parent.joined_s, now)
        if parent.waiting_for == 0:
            group = parent.session.steps[parent.step]
            assert isinstance(group, SubagentGroup)
            parent.step += 1
            parent.base_s = parent.joined_s + self.scaling.pause(group.resume_s)
            parent.joined = True  # the next request's recorded think time counted the wait for the subagents
            self._next_step(parent)

    # -- figures -----------------------------------------------------------------------------------------------
    def _summary(self, runs: list[_Session]) -> dict:
        jcts = [run.end_s - run.start_s for run in runs if run.end_s is not None]
        prompt = sum(run.prompt_tokens for run in runs)
        hit = sum(run.hit_tokens for run in runs)
        res = self.sim.result
        retention = self.kv.retention.summary()
        return {
            "policy": self.policy.name,
            "sessions": len(runs),
            "requests": sum(run.requests for run in runs),
            "rejected_requests": sum(run.rejected for run in runs),
            "prompt_tokens": prompt,
            "hit_tokens": hit,
            "token_hit_rate": ratio(hit, prompt),
            "jct_s": jct_stats(jcts),
            "jct_by_session": {run.id: run.end_s - run.start_s for run in runs if run.end_s is not None},
            "rejected_by_session": {run.id: sorted(run.rejected_steps) for run in runs if run.rejected},
            "sim_seconds": res.sim_seconds,
            "steps": self.sim.scheduler.step_count,
            "preemptions": self.sim.scheduler.num_preemptions,
            "evicted_pages": self.kv.stats.evicted_pages,
            "missed_tokens_by_cause": missed_by_cause([self.kv]),
            "retention_released_by_cap": retention["retention_released_by_cap"],
            "retention_expired": retention["retention_expired"],
            **self.pins.summary(),
            **(self.copier.stats() if self.copier is not None else {}),
            "pool_pages": self.kv.num_pages,
            "page_size": self.kv.page_size,
        }


def jct_stats(jcts: list[float]) -> dict:
    return {
        "mean": ratio(sum(jcts), len(jcts)),
        "p50": percentile(jcts, 50),
        "p90": percentile(jcts, 90),
        "max": max(jcts, default=float("nan")),
    }


def common_sessions(runs: list[dict]) -> list[str]:
    """The sessions that compare across `runs`: each run served the same requests of them. A session that lost a
    rejected request (too long for that pool) goes on without it and ends sooner, so its JCT compares only
    between runs that rejected the same of its requests (none, or the same ones)."""
    if not runs:
        return []
    first = runs[0].get("rejected_by_session", {})
    return [
        sid
        for sid in runs[0]["jct_by_session"]
        if all(r.get("rejected_by_session", {}).get(sid, []) == first.get(sid, []) for r in runs)
    ]


def mean_jct(run: dict, sessions: list[str]) -> float:
    return ratio(sum(run["jct_by_session"][sid] for sid in sessions), len(sessions))


def add_common_jct(runs: list[dict]) -> list[str]:
    """Each run's JCT over the sessions that compare across all of them (`jct_common_s`), and whether its own
    covers whole sessions (`comparable`: it rejected nothing). Returns the common sessions."""
    common = common_sessions(runs)
    for r in runs:
        r["jct_common_s"] = jct_stats([r["jct_by_session"][sid] for sid in common]) | {"sessions": len(common)}
        r["comparable"] = not r["rejected_requests"]
    return common


def replay_sessions(
    config: EngineConfig,
    cost: StepCostModel,
    scaling: AgentScaling,
    mapping: BlockTokens,
    policy: SessionPolicy,
    sessions: list[AgentSession],
    starts: list[float],
    check_every: int = 0,
    tier: SimTierOptions | None = None,
) -> SessionResult:
    return SessionReplay(config, cost, scaling, mapping, policy, check_every, tier).run(sessions, starts)
