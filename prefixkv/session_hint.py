"""What a client may say about the agent session a request belongs to (docs/agent_traces.md).

An agent framework knows what a cache cannot guess: which requests are one session's turns, which session is a
subagent of which, how long the agent will be away (a tool is running), and when a session is over. vLLM's and
Dynamo's request hint envelopes carry the same things; here they drive the engine's session pins
(engine/agent_sessions.py). Sessions are per cache namespace: the same id under two tenants is two sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SESSION_ID_CHARS = 256
SESSION_ACTIONS = ("keep", "release")


@dataclass(frozen=True, slots=True)
class SessionHint:
    id: str  # the session (or subagent) this request is a turn of
    parent: str | None = None  # the session that started this one (a subagent's parent)
    expected_pause_s: float | None = None  # after this answer, how long until the session's next request
    action: str = "keep"  # "release": the session ends with this request; its pins (and its subagents') go

    def __post_init__(self) -> None:
        for name, value in (("id", self.id), ("parent", self.parent)):
            if value is None and name == "parent":
                continue
            if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID_CHARS:
                raise ValueError(
                    f"session {name} must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters"
                )
        pause = self.expected_pause_s
        if pause is not None and (
            isinstance(pause, bool) or not isinstance(pause, (int, float)) or not math.isfinite(pause) or pause < 0
        ):
            raise ValueError(f"session expected_pause_s must be a number >= 0, got {pause!r}")
        if self.action not in SESSION_ACTIONS:
            raise ValueError(f"session action must be one of {', '.join(SESSION_ACTIONS)}, got {self.action!r}")
