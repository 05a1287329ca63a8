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

The table of sessions is bounded (`max_sessions`, least recently active dropped, its pins let go) and keyed by
(cache namespace, session id).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from prefixkv.engine.prompts import shared_prefix
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams

SESSION_POLICIES = ("none", "ttl", "pause", "session")


def return_priority(now_s: float, pause_s: float) -> int:
    """The sooner the session is expected back, the stronger its pin (Belady's rule with the hint for the future)."""
    return -int(now_s + max(pause_s, 0.0))


@dataclass
class _Session:
    pinned: list[int] | None = None  # the token ids whose cached pages the session holds pinned
    children: set[tuple] = field(default_factory=set)  # subagent sessions' keys


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
    ) -> None:
        if policy not in SESSION_POLICIES:
            raise ValueError(f"unknown session policy {policy!r} (known: {', '.join(SESSION_POLICIES)})")
        for name, value in (("ttl_seconds", ttl_seconds), ("max_pin_seconds", max_pin_seconds)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not grace >= 1:
            raise ValueError(f"grace must be >= 1, got {grace}")
        self.kv, self.policy = kv, policy
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

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def _key(request: Request, session_id: str) -> tuple:
        return (request.cache_salt, request.lora_id, session_id)

    def on_add(self, request: Request) -> None:
        """The session's next request arrived: under `session`, its prompt shows which pinned pages it extends;
        those stay pinned, ranked as due now (it may wait in the queue), the rest are let go."""
        hint = request.session
        if hint is None or self.policy == "none":
            return
        key = self._key(request, hint.id)
        session = self._touch(key)
        if hint.parent is not None:
            self._touch(self._key(request, hint.parent)).children.add(key)
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
        if self.policy == "none":
            return
        key = self._key(request, hint.id)
        if hint.action == "release":
            self._end(key)
            return
        session = self._touch(key)
        pause = hint.expected_pause_s
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

    # -- internals ---------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.kv.retention.clock()

    def _touch(self, key: tuple) -> _Session:
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session()
            while len(self._sessions) > self.max_sessions:
                old_key, old = self._sessions.popitem(last=False)
                self._unpin(old_key, old)
        else:
            self._sessions.move_to_end(key)
        return session

    def _end(self, key: tuple) -> None:
        """The session is over: its pins and its subagents' go, and it is forgotten."""
        session = self._sessions.pop(key, None)
        if session is None:
            return
        self._unpin(key, session)
        for child in session.children:
            self._end(child)

    def _probe(self, key: tuple, tokens: list[int]) -> Request:
        """A request over `tokens` in the session's namespace (key: cache salt, adapter, session id)."""
        self._probes += 1
        return Request(
            f"session-pin-{self._probes}",
            [*tokens, 0],  # the sequence's own last page counts too
            SamplingParams(max_tokens=1),
            cache_salt=key[0],
            lora_id=key[1],
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
            "session_policy": self.policy,
            "tracked_sessions": len(self._sessions),
            "session_pinned_pages": self.pinned_pages,
            "session_released_pages": self.released_pages,
            "session_demoted_chunks": self.demoted_chunks,
        }
