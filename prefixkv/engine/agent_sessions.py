"""Session pins: what the engine does with the clients' session hints (prefixkv/session_hint.py).

A coding agent's session resends its whole conversation every turn and pauses between turns while its tools run;
under LRU, other sessions' traffic evicts a paused session's KV and its next turn recomputes it. The policies
(docs/agent_traces.md), applied when a hinted request finishes and when the session's next request arrives:
- none: hints are recorded, nothing is pinned.
- ttl: every answer pins the session's sequence (prompt + answer) for a fixed `ttl_seconds`.
- pause: every answer pins the sequence through the announced pause x `grace` + 1 s (CacheTTL's pin through a
  tool call); no announced pause, no pin.
- session: a-posteriori priority. Every answer pins the sequence until the session's next request supersedes it
  (bounded by `max_pin_seconds`): the pages that request extends stay pinned, the rest are let go; a request with
  action "release" ends the session and lets go of its pins and its subagents'.
A session's new pin replaces its last one. The hinted pins (pause, session) rank by when the session is expected
back (the retention table's priority, -(now + pause) in whole seconds): when the retention cap is reached, or only
pinned pages are left to evict, the latest return goes first. Every such priority is far below 0, so a session pin
always yields to the explicit retentions (prompt_cache_retention, cache breakpoints, /v1/caches entries). The
retention cap (retained_pool_fraction) bounds the pins, so they never starve admission.

With `demote` (the engine sets it with a write_back second tier), every answer also hands its sequence to the tier
at once: the pause is when to write it, and the pool may then evict it at no cost (Tokencake's offload during tool
stalls).

With `+prefetch` after the policy (`session+prefetch`; it needs a second tier: the simulator's name for the same
action, sim/sessions.py), every answer with an announced pause P also schedules a read-ahead of its sequence: at
answer + P - lead (lead: reading the whole sequence at the tier's measured rate, plus DEFAULT_PREFETCH_LEAD_S), the
chunks of it that only the tier still holds are read in the background (TieredKVCache.read_ahead: staged by chunk
key, within the tier's staging bound), so that the next turn's admission finds them read instead of waiting on the
tier. The engine runs the due read-aheads at each step and, idle, when the next one is due (run_timers). The
session's next request supersedes it: not started, it is cancelled; started, that request's prefetch takes over what
it extends and the rest is dropped. A release drops it, and so does the pause policy's horizon (P x grace + 1 s
after the answer): a session that never comes back holds no staged bytes past it (the staging bound drops the oldest
before that, under pressure).

The table of sessions is bounded (`max_sessions`, least recently active dropped, its pins let go) and keyed by
(cache namespace, session id).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from prefixkv.engine.prompts import shared_prefix
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request
from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams

SESSION_POLICIES = ("none", "ttl", "pause", "session")
PREFETCH = "+prefetch"  # after a policy: read each turn's sequence back from the tier before its pause ends
# How long before the session is due back its read-ahead starts, on top of reading the whole sequence at the
# tier's measured rate (the simulator starts it that late too). The engine notices a due read-ahead only between
# steps (a CPU step takes up to about a second), and an announced pause is an estimate; starting a second early
# holds the staged bytes a second longer, starting late makes the admission wait on the tier.
DEFAULT_PREFETCH_LEAD_S = 1.0


def return_priority(now_s: float, pause_s: float) -> int:
    """The sooner the session is expected back, the stronger its pin (Belady's rule with the hint for the future)."""
    return -int(now_s + max(pause_s, 0.0))


@dataclass(eq=False)
class _ReadAhead:
    """A finished turn's sequence to read back from the tier before the session is due back."""

    tokens: list[int]
    start_s: float
    expire_s: float  # dropped then if the session has not come back
    started: bool = False


@dataclass
class _Session:
    pinned: list[int] | None = None  # the token ids whose cached pages the session holds pinned
    children: set[tuple] = field(default_factory=set)  # subagent sessions' keys
    ahead: _ReadAhead | None = None  # +prefetch: its last turn's read-ahead, until the next turn or its expiry


class SessionPins:
    def __init__(
        self,
        kv: KVCacheManager,
        policy: str = "session",
        ttl_seconds: float = 300.0,
        grace: float = 1.25,
        max_pin_seconds: float = 3600.0,
        max_sessions: int = 10_000,
        demote: bool = False,
        prefetch_lead_s: float = DEFAULT_PREFETCH_LEAD_S,
    ) -> None:
        """policy: one of SESSION_POLICIES, optionally followed by +prefetch (which needs kv with a tier)."""
        name, prefetch = policy, policy.endswith(PREFETCH)
        policy = policy.removesuffix(PREFETCH)
        if policy not in SESSION_POLICIES:
            raise ValueError(
                f"unknown session policy {name!r} (known: {', '.join(SESSION_POLICIES)}, each optionally {PREFETCH})"
            )
        if prefetch and not kv.reads_ahead:
            raise ValueError(
                f"session policy {name!r} reads each turn back from the second KV tier before its pause ends: it "
                "needs a tier (kv_offload_dir or kv_offload_host_size)"
            )
        for label, value in (("ttl_seconds", ttl_seconds), ("max_pin_seconds", max_pin_seconds)):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if not grace >= 1:
            raise ValueError(f"grace must be >= 1, got {grace}")
        if not prefetch_lead_s >= 0:
            raise ValueError(f"prefetch_lead_s must be >= 0, got {prefetch_lead_s}")
        self.kv, self.policy, self.name, self.prefetch = kv, policy, name, prefetch
        self.prefetch_lead_s = prefetch_lead_s
        self.ttl_seconds, self.grace, self.max_pin_seconds = ttl_seconds, grace, max_pin_seconds
        self.max_sessions = max_sessions
        self.demote = demote
        self.demoted_chunks = 0  # chunks handed to the second tier at pause starts
        self._sessions: OrderedDict[tuple, _Session] = OrderedDict()
        # sessions holding a pin, by namespace and first page: a pin let go keeps what another one shares with it
        self._pinned_by_head: dict[tuple, set[tuple]] = {}
        self._probes = 0
        self.pinned_pages = 0  # pages pinned, counted at each pin
        self.released_pages = 0  # pins let go (superseded, ended, dropped)
        # +prefetch: (due, tie-break, session key, read-ahead) to start or expire; one live entry a session at most,
        # the others (superseded) skipped when due
        self._timers: list[tuple[float, int, tuple, _ReadAhead]] = []
        self._timer_ids = itertools.count()
        self.read_aheads = 0  # read-aheads started
        self.read_ahead_chunks = 0  # chunk reads they started
        self.read_ahead_dropped_chunks = 0  # of those, dropped untaken (superseded, released, expired)
        self.read_aheads_expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def _key(request: Request, session_id: str) -> tuple:
        return (request.cache_salt, request.lora_id, session_id)

    def on_add(self, request: Request) -> None:
        """The session's next request arrived: under `session`, its prompt shows which pinned pages it extends;
        those stay pinned, ranked as due now (it may wait in the queue), the rest are let go."""
        hint = request.session
        if hint is None or (self.policy == "none" and not self.prefetch):
            return
        key = self._key(request, hint.id)
        session = self._touch(key)
        if hint.parent is not None:
            self._touch(self._key(request, hint.parent)).children.add(key)
        # back before or during its read-ahead: the request's own prefetch (it is queued next) takes over the
        # chunks its prompt extends; the rest are dropped
        self._cancel_read_ahead(key, session, keep=request.prompt_token_ids)
        if self.policy != "session" or session.pinned is None:
            return
        kept = session.pinned[: shared_prefix(session.pinned, request.prompt_token_ids)]
        self._unpin(key, session)
        if kept:
            self._pin(key, session, kept, self.max_pin_seconds, return_priority(self._now(), 0.0))

    def on_finish(self, request: Request, aborted: bool = False) -> None:
        """A hinted request finished (its pages are cached, no longer held): pin its sequence for the pause, or
        end the session."""
        hint = request.session
        if hint is None or (aborted and hint.action != "release"):
            return
        if self.demote and hint.action == "keep":
            self.demoted_chunks += self.kv.demote(request)
        if self.policy == "none" and not self.prefetch:
            return
        key = self._key(request, hint.id)
        if hint.action == "release":
            self._end(key)
            return
        session = self._touch(key)
        pause = hint.expected_pause_s
        if self.prefetch and pause is not None:
            self._schedule_read_ahead(key, session, list(request.token_ids), pause)
        if self.policy == "none":
            return
        if self.policy == "ttl":
            seconds, priority = self.ttl_seconds, 0
        elif self.policy == "pause":
            if pause is None:
                return
            seconds, priority = pause * self.grace + 1.0, return_priority(self._now(), pause)
        else:
            seconds, priority = self.max_pin_seconds, return_priority(self._now(), pause or 0.0)
        if self.policy != "ttl":
            self._unpin(key, session)
        self._pin(key, session, list(request.token_ids), seconds, priority)

    def run_timers(self) -> float | None:
        """Start the read-aheads due now, drop the expired ones; the seconds until the next is due (None: none is
        pending). The engine calls it at each step, and when idle, again after that long."""
        if not self._timers:  # every step asks: without +prefetch nothing is ever pending
            return None
        now = self._now()
        while self._timers and self._timers[0][0] <= now:
            _, _, key, ahead = heapq.heappop(self._timers)
            session = self._sessions.get(key)
            if session is None or session.ahead is not ahead:
                continue  # superseded or ended
            if not ahead.started:
                ahead.started = True
                self.read_aheads += 1
                probe = self._probe(key, ahead.tokens)
                try:
                    self.read_ahead_chunks += self.kv.read_ahead(probe)
                finally:
                    self.kv.free(probe)
                self._push_timer(ahead.expire_s, key, ahead)
            else:
                self.read_aheads_expired += 1
                self._cancel_read_ahead(key, session)
        while self._timers:
            due, _, key, ahead = self._timers[0]
            session = self._sessions.get(key)
            if session is not None and session.ahead is ahead:
                return max(due - now, 0.0)
            heapq.heappop(self._timers)
        return None

    # -- internals ---------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.kv.retention.clock()

    def _schedule_read_ahead(self, key: tuple, session: _Session, tokens: list[int], pause: float) -> None:
        """Read the sequence back lead before the session is due (as late as its measured read time allows)."""
        self._cancel_read_ahead(key, session)
        now = self._now()
        lead = self.prefetch_lead_s + self.kv.expected_read_seconds(len(tokens))
        session.ahead = _ReadAhead(tokens, max(now, now + pause - lead), now + pause * self.grace + 1.0)
        self._push_timer(session.ahead.start_s, key, session.ahead)

    def _push_timer(self, due: float, key: tuple, ahead: _ReadAhead) -> None:
        heapq.heappush(self._timers, (due, next(self._timer_ids), key, ahead))
        if len(self._timers) > 2 * len(self._sessions) + 64:  # superseded entries: keep the heap bounded
            self._timers = [t for t in self._timers if (s := self._sessions.get(t[2])) is not None and s.ahead is t[3]]
            heapq.heapify(self._timers)

    def _cancel_read_ahead(self, key: tuple, session: _Session, keep: list[int] | None = None) -> None:
        """Forget the session's read-ahead; what it read and no request took is dropped, except the chunks
        within the prefix it shares with `keep` (the prompt of the request about to take them)."""
        ahead, session.ahead = session.ahead, None
        if ahead is None or not ahead.started:
            return
        probe = self._probe(key, ahead.tokens)
        try:
            keep_tokens = shared_prefix(ahead.tokens, keep) if keep is not None else 0
            self.read_ahead_dropped_chunks += self.kv.drop_read_ahead(probe, keep_tokens)
        finally:
            self.kv.free(probe)

    def _touch(self, key: tuple) -> _Session:
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session()
            while len(self._sessions) > self.max_sessions:
                old_key, old = self._sessions.popitem(last=False)
                self._unpin(old_key, old)
                self._cancel_read_ahead(old_key, old)
        else:
            self._sessions.move_to_end(key)
        return session

    def _end(self, key: tuple) -> None:
        """The session is over: its pins and its subagents' go, and it is forgotten."""
        session = self._sessions.pop(key, None)
        if session is None:
            return
        self._unpin(key, session)
        self._cancel_read_ahead(key, session)
        for child in session.children:
            self._end(child)

    def _probe(self, key: tuple, tokens: list[int]) -> Request:
        """A request over `tokens` in the session's namespace (key: cache salt, adapter, session id)."""
        self._probes += 1
        return Request(
            f"session-pin-{self._probes}",
            [*tokens, 0],  # the sequence's own last page counts too
            RequestOptions(SamplingParams(max_tokens=1), cache_salt=key[0], lora_id=key[1]),
        )

    def _head(self, key: tuple, tokens: list[int]) -> tuple:
        return (key[0], key[1], tuple(tokens[: self.kv.page_size]))

    def _pin(self, key: tuple, session: _Session, tokens: list[int], seconds: float, priority: int) -> None:
        probe = self._probe(key, tokens)
        try:
            self.pinned_pages += self.kv.retain_cached(probe, seconds, priority)
        finally:
            self.kv.free(probe)
        session.pinned = tokens
        self._pinned_by_head.setdefault(self._head(key, tokens), set()).add(key)

    def _unpin(self, key: tuple, session: _Session) -> None:
        """Let go of the session's pin, except the prefix it shares with another session's pin (a subagent and
        its parent, two agents with one system prompt: the retention table keeps one retention per page, so
        releasing it would end the other's pin too; the shared pages keep the stronger of the two)."""
        if session.pinned is None:
            return
        head = self._head(key, session.pinned)
        sharing = self._pinned_by_head.get(head, set())
        sharing.discard(key)
        if not sharing:
            self._pinned_by_head.pop(head, None)
        keep = 0
        for other_key in sharing:
            other = self._sessions.get(other_key)
            if other is not None and other.pinned is not None:
                keep = max(keep, shared_prefix(session.pinned, other.pinned))
        probe = self._probe(key, session.pinned)
        try:
            self.released_pages += self.kv.release_retention(probe, keep)
        finally:
            self.kv.free(probe)
        session.pinned = None

    def summary(self) -> dict:
        return {
            "session_policy": self.name,
            "tracked_sessions": len(self._sessions),
            "session_pinned_pages": self.pinned_pages,
            "session_released_pages": self.released_pages,
            "session_demoted_chunks": self.demoted_chunks,
            **(self._read_ahead_summary() if self.prefetch else {}),
        }

    def _read_ahead_summary(self) -> dict:
        return {
            "session_read_aheads": self.read_aheads,
            "session_read_ahead_chunks": self.read_ahead_chunks,
            "session_read_ahead_dropped_chunks": self.read_ahead_dropped_chunks,
            "session_read_aheads_expired": self.read_aheads_expired,
        }
