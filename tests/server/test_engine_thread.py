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
