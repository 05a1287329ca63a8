"""on_short_lived_thread: what `prefixkv serve` and each Ray replica build their engine with (engine_thread.py)."""

from __future__ import annotations

import threading

import pytest

from prefixkv.server.engine_thread import on_short_lived_thread


def test_runs_on_a_thread_that_has_ended_and_returns_its_result():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert on_short_lived_thread(work) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()  # its OpenMP team, if it started one, went with it


def test_its_error_is_raised_on_the_caller():
    def fail() -> None:
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config"):
        on_short_lived_thread(fail)


def test_the_idle_engine_loop_wakes_when_the_engines_next_timer_is_due():
    """AsyncEngine's loop (server/async_engine.py), with nothing to step and no command, still runs the engine's
    timers when they are due (a session's read-ahead before its pause ends, engine/agent_sessions.py)."""
    from prefixkv.server.async_engine import AsyncEngine

    class IdleEngine:  # nothing to step; a timer due 10 ms after each call, twice, then none
        def __init__(self) -> None:
            self.calls, self.third = 0, threading.Event()

        def has_unfinished_requests(self) -> bool:
            return False

        def run_timers(self) -> float | None:
            self.calls += 1
            if self.calls == 3:
                self.third.set()
            return 0.01 if self.calls < 3 else None

        def close(self) -> None:
            pass

    engine = IdleEngine()
    loop = AsyncEngine(engine)  # type: ignore[arg-type]
    loop.start()
    try:
        assert engine.third.wait(10)  # a hang guard only: woken twice by its timers, by no command
    finally:
        loop.shutdown()
    assert engine.calls == 3  # then it blocks on its commands until the stop
