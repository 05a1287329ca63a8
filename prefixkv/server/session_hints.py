"""Agent-session hints over HTTP (prefixkv/session_hint.py; what they do: engine/agent_sessions.py).

Headers, on every route that generates (a header reaches the engine without touching any API's body schema):
  x-session-id                 the session this request is a turn of (a subagent: its own id)
  x-session-parent-id          the session that started this one
  x-session-expected-pause-s   after this answer, seconds until the session's next request (a tool's run time)
  x-session-action             keep (default) | release: the session ends with this request
No API field is read as a session id, on purpose: a session's next turn supersedes its pins, so two agents under
one id undo each other's. metadata.user_id (Messages) is one per Claude Code session, its subagents included;
prompt_cache_key (OpenAI) is shared, by OpenAI's guidance, by every user of a prefix. A client maps its own ids
to the headers (the SDKs' extra headers).
"""

from __future__ import annotations

from fastapi import Request

from prefixkv.server.errors import APIError
from prefixkv.session_hint import MAX_SESSION_ID_CHARS, SESSION_ACTIONS, SessionHint

ID, PARENT, PAUSE, ACTION = "x-session-id", "x-session-parent-id", "x-session-expected-pause-s", "x-session-action"


def session_hint(raw: Request) -> SessionHint | None:
    """The request's hint, or None without a session id; a malformed header is a 400 naming it."""
    headers = raw.headers
    session_id = headers.get(ID)
    if not session_id:
        given = [name for name in (PARENT, PAUSE, ACTION) if name in headers]
        if given:
            raise APIError(f"header {given[0]} needs {ID}", param=given[0], code="invalid_value")
        return None
    pause: float | None = None
    if PAUSE in headers:
        try:
            pause = float(headers[PAUSE])
        except ValueError:
            raise APIError(f"header {PAUSE} must be a number of seconds", param=PAUSE, code="invalid_value") from None
    action = headers.get(ACTION, "keep")
    if action not in SESSION_ACTIONS:
        raise APIError(
            f"header {ACTION} must be one of {', '.join(SESSION_ACTIONS)}", param=ACTION, code="invalid_value"
        )
    for name, value in ((ID, session_id), (PARENT, headers.get(PARENT))):
        if value is not None and len(value) > MAX_SESSION_ID_CHARS:
            raise APIError(f"header {name} is longer than {MAX_SESSION_ID_CHARS} characters", param=name)
    try:
        return SessionHint(session_id, headers.get(PARENT), pause, action)
    except ValueError as exc:  # a negative or infinite pause
        raise APIError(f"header {PAUSE}: {exc}", param=PAUSE, code="invalid_value") from None
