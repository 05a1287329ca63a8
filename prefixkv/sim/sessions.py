"""Agent sessions replayed closed loop through the simulator, under session-aware cache policies.

A session's next request is issued its think time after the previous answer (a slow engine slows the session, as
in reality); a group of subagents starts at the recorded offsets and the parent resumes after the last of them.
The engine is the simulator's (simulator.Simulation: the real scheduler and KV cache on a simulated clock); this
module only decides when requests arrive and what the cache is told between them.

Policies (what the cache is told at the pauses; the eviction order among unpinned pages stays the cache's own):
- lru: nothing (today's engine: a paused session's pages age like any other).
- ttl: every answer pins the agent's prompt for a fixed time (`pin_seconds`), as a hosted API's cache TTL does.
- pause: every answer pins the prompt through the pause the client announces (the next think time, or the
  subagents' recorded span), a little longer (`grace`): CacheTTL's pin through a tool call.
- session: a-posteriori priority. Every answer pins the prompt with no deadline; when the agent's next request
  arrives, the pages it extends stay pinned and the rest are let go; an agent that ends (a finished subagent, a
  finished session) lets go of all of its pins.
The hinted pins (pause, session) are ranked by when the agent is expected back (its answer time + the announced
pause): when the retention cap is reached, or only pinned pages are left to evict, the latest return goes first.
A new pin of an agent replaces its last one. The retention cap (`retained_pool_fraction`) bounds every policy's
pins, so none can starve admission. Known simplification: subagents of one session that share a prefix pin it
each, and one letting go unpins the shared pages for both.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixkv.config import EngineConfig
from prefixkv.engine.policy_factory import create_policy
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams
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
from prefixkv.sim.traces import BlockTokens
from prefixkv.stats import percentile, ratio

POLICIES = ("lru", "ttl", "pause", "session")
UNTIL_RELEASED_S = 1e12  # a session pin's deadline: it ends when superseded, not by time


@dataclass(frozen=True)
class SessionPolicy:
    name: str = "lru"
    pin_seconds: float = 300.0  # ttl: Anthropic's default cache lifetime (5 minutes)
    grace: float = 1.25  # pause: the pin lasts the announced pause x grace + 1 s (an estimate may run late)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown session policy {self.name!r} (known: {', '.join(POLICIES)})")
        if not (math.isfinite(self.pin_seconds) and self.pin_seconds > 0):
            raise ValueError(f"pin_seconds must be > 0, got {self.pin_seconds}")
        if not (math.isfinite(self.grace) and self.grace >= 1):
            raise ValueError(f"grace must be >= 1, got {self.grace}")


def return_priority(now_s: float, pause_s: float) -> int:
    """A pin's rank from the client's hint: the sooner the agent is expected back (now + the announced pause, in
    whole seconds), the stronger, so the retention cap and eviction let go of the latest return first (Belady's
    rule with the hint standing in for the future)."""
    return -int(now_s + max(pause_s, 0.0))


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
    pinned: AgentPrompt | None = None  # its last prompt, while the policy keeps a pin on it
    joined: bool = False  # its subagents just joined: the recorded resume gap replaces the next think time


@dataclass
class _Session:
    id: str
    start_s: float
    end_s: float | None = None
    requests: int = 0
    rejected: int = 0
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
    ) -> None:
        self.config, self.scaling, self.mapping, self.policy = config, scaling, mapping, policy
        self.clock = SimClock()
        self.kv: KVCacheManager = create_kv(config, self.clock)
        self.sim = Simulation(
            config, self.kv, create_policy(config), cost, clock="seconds", check_every=check_every, sim_clock=self.clock
        )
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._by_request: dict[str, tuple[_Agent, AgentPrompt]] = {}
        self._ids = itertools.count()
        self._seen_metrics = 0
        self._arrived: list[tuple[str, AgentPrompt]] = []  # (request id, prompt) in arrival order
        self._rejected: set[str] = set()
        self.answered: list[Answered] = []

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self, sessions: list[AgentSession], starts: list[float]) -> SessionResult:
        if len(sessions) != len(starts):
            raise ValueError("one start time per session")
        runs = []
        for k, (session, start) in enumerate(zip(sessions, starts, strict=True)):
            run = _Session(f"{k}:{session.id}", start)
            runs.append(run)
            agent = _Agent(session, run, None, base_s=start)
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
            agent, prompt = self._by_request.pop(m.request_id)
            run = agent.root
            run.requests += 1
            if m.rejected:
                run.rejected += 1
                self._rejected.add(m.request_id)
            else:
                run.prompt_tokens += m.prompt_tokens
                run.hit_tokens += m.hit_tokens
            now = self.sim.now()
            self.answered.append(
                Answered(agent.session.id, m.arrival_s, now, m.prompt_tokens, m.hit_tokens, m.rejected)
            )
            self._answered(agent, prompt, now)

    # -- an agent's steps --------------------------------------------------------------------------------------
    def _next_step(self, agent: _Agent) -> None:
        """Start the agent's current step: issue its request after the think time, or start its subagents."""
        if agent.step >= len(agent.session.steps):
            self._ended(agent, agent.base_s)
            return
        step = agent.session.steps[agent.step]
        if isinstance(step, AgentRequest):
            due = agent.base_s + (0.0 if agent.joined else self.scaling.pause(step.think_s))
            agent.joined = False
            self._at(due, lambda: self._issue(agent, step, due))
            return
        agent.waiting_for = len(step.agents)
        agent.joined_s = agent.base_s
        for delay, sub in zip(step.delays_s, step.agents, strict=True):
            child = _Agent(sub, agent.root, agent, base_s=agent.base_s + self.scaling.pause(delay))
            self._at(child.base_s, functools.partial(self._next_step, child))

    def _issue(self, agent: _Agent, step: AgentRequest, due: float) -> None:
        prompt = scaled_prompt(step, self.scaling, self.mapping)
        self._superseded(agent, prompt)
        request_id = f"s{next(self._ids)}"
        self._by_request[request_id] = (agent, prompt)
        self._arrived.append((request_id, prompt))
        arrival = Arrival(due, request_id, prompt.prompt_len, self.scaling.output_len(step), prompt.prompt_tokens)
        arrival.group = agent.root.id
        self.sim.arrive(arrival)

    def _answered(self, agent: _Agent, prompt: AgentPrompt, now: float) -> None:
        agent.step += 1
        agent.base_s = now
        self._pin(agent, prompt, self._pause_after(agent))
        self._next_step(agent)

    def _ended(self, agent: _Agent, now: float) -> None:
        self._unpin(agent)  # the client says the agent is done (pause and session policies)
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

    def _pause_after(self, agent: _Agent) -> float:
        """The pause the client announces after an answer: the next think time, or its subagents' recorded span."""
        if agent.step >= len(agent.session.steps):
            return 0.0
        step = agent.session.steps[agent.step]
        if isinstance(step, AgentRequest):
            return self.scaling.pause(step.think_s)
        pause = self.scaling.pause
        return max(pause(d) + a.recorded_s for d, a in zip(step.delays_s, step.agents, strict=True)) + pause(
            step.resume_s
        )

    # -- what the cache is told -------------------------------------------------------------------------------
    def _pin(self, agent: _Agent, prompt: AgentPrompt, pause_s: float) -> None:
        name = self.policy.name
        last = agent.step >= len(agent.session.steps)
        if name == "lru" or (last and name != "ttl"):
            return
        if name == "ttl":
            self._retain(prompt, self.policy.pin_seconds, 0)
            return
        # the new pin replaces the agent's last one (a page keeps the stronger of two pins, so the old rank stays
        # unless let go first)
        self._unpin(agent)
        seconds = pause_s * self.policy.grace + 1.0 if name == "pause" else UNTIL_RELEASED_S
        self._retain(prompt, seconds, return_priority(self.clock.now(), pause_s))
        agent.pinned = prompt

    def _unpin(self, agent: _Agent) -> None:
        if agent.pinned is not None:
            self._release(agent.pinned, 0)
            agent.pinned = None

    def _superseded(self, agent: _Agent, prompt: AgentPrompt) -> None:
        """The session policy's a-posteriori step, when the agent's next request arrives: its prompt shows which
        of the pinned pages it extends; those stay pinned, ranked as due now (the request may wait in the queue),
        and the rest lose their pin (they stay cached, as ordinary pages)."""
        if self.policy.name != "session" or agent.pinned is None:
            return
        old, common = agent.pinned, 0
        for a, b in zip(old.block_ids, prompt.block_ids, strict=False):
            if a != b:
                break
            common += 1
        self._unpin(agent)
        kept = min(common * self.scaling.tokens_per_block, old.prompt_len, prompt.prompt_len)
        if kept:
            extended = AgentPrompt(kept, old.block_ids[:common], old.tokens_per_block, old.mapping)
            self._retain(extended, UNTIL_RELEASED_S, return_priority(self.clock.now(), 0.0))
            agent.pinned = extended

    def _probe(self, prompt: AgentPrompt) -> Request:
        # the prompt's own last page counts too (as the engine's release_retention probes it)
        return Request(f"pin-{next(self._ids)}", [*prompt.prompt_tokens(), 0], SamplingParams(max_tokens=1))

    def _retain(self, prompt: AgentPrompt, seconds: float, priority: int) -> None:
        probe = self._probe(prompt)
        try:
            self.kv.retain_cached(probe, seconds, priority)
        finally:
            self.kv.free(probe)

    def _release(self, prompt: AgentPrompt, keep_tokens: int) -> None:
        probe = self._probe(prompt)
        try:
            self.kv.release_retention(probe, keep_tokens)
        finally:
            self.kv.free(probe)

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
            "jct_s": {
                "mean": ratio(sum(jcts), len(jcts)),
                "p50": percentile(jcts, 50),
                "p90": percentile(jcts, 90),
                "max": max(jcts, default=float("nan")),
            },
            "jct_by_session": {run.id: run.end_s - run.start_s for run in runs if run.end_s is not None},
            "sim_seconds": res.sim_seconds,
            "steps": self.sim.scheduler.step_count,
            "preemptions": self.sim.scheduler.num_preemptions,
            "evicted_pages": self.kv.stats.evicted_pages,
            "missed_tokens_by_cause": missed_by_cause([self.kv]),
            "retention_released_by_cap": retention["retention_released_by_cap"],
            "retention_expired": retention["retention_expired"],
            "pool_pages": self.kv.num_pages,
            "page_size": self.kv.page_size,
        }


def replay_sessions(
    config: EngineConfig,
    cost: StepCostModel,
    scaling: AgentScaling,
    mapping: BlockTokens,
    policy: SessionPolicy,
    sessions: list[AgentSession],
    starts: list[float],
    check_every: int = 0,
) -> SessionResult:
    return SessionReplay(config, cost, scaling, mapping, policy, check_every).run(sessions, starts)
