"""Why a served engine is built (and prewarmed) on a thread that then ends: so that the engine thread, which steps
it, is the only live thread that ever ran the model's parallel kernels.

GNU OpenMP (torch's CPU wheel) keeps a team of worker threads for every thread that ran a parallel region, for as
long as that thread lives. Loading the model on the main thread leaves the main thread's workers alive beside the
engine thread's own; once the workers of all teams outnumber the cores, GNU OpenMP spins only ~100 rounds before
a worker sleeps (its throttled spin), so every one of a decode step's hundreds of short parallel regions pays a
wake-up. On 2 cores (AMD EPYC, bf16, one stream) that made a served decode step 10.5 ms against 6.7 ms in the
process that loaded the model; a loader thread that ends takes its team with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_short_lived_thread(fn: Callable[[], T], name: str = "prefixkv-loader") -> T:
    """fn() on a new thread, joined: its result, or its exception raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
