"""Run a built app under uvicorn with the server's limits: the one place `prefixkv serve` and the tests'
in-process server get their uvicorn configuration from, so tests exercise what production runs.

Shutdown (SIGTERM, Ctrl-C, or `server.should_exit = True`): uvicorn stops accepting and waits for open
requests; DrainingServer first tells the app, which cuts whatever still runs `shutdown_timeout` seconds later
(streams end with an error event and [DONE], their engine requests are aborted). uvicorn's own cancellation
stays as a backstop a few seconds after that. A drained shutdown exits 0: uvicorn would re-raise the signal
after its shutdown, which kills the process with "terminated by SIGTERM" instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import resource
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from prefixkv.server.connection import GuardedH11Protocol
from prefixkv.server.limits import ServerLimits

logger = logging.getLogger(__name__)

_BACKSTOP_SECONDS = 5.0  # after shutdown_timeout: uvicorn cancels what our own cut did not end


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # drained: a clean exit, not death by the signal


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> DrainingServer:
    """A uvicorn server for an app from build_app(); its limits come from the app (app.state.limits)."""
    limits: ServerLimits = app.state.limits
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=functools.partial(GuardedH11Protocol, limits=limits),  # type: ignore[arg-type]
        timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]  # uvicorn takes floats too
        timeout_graceful_shutdown=limits.shutdown_timeout + _BACKSTOP_SECONDS,  # type: ignore[arg-type]
        ws="none",
        lifespan="on",
    )
    return DrainingServer(config, on_shutdown=lambda: app.state.server.begin_shutdown(limits.shutdown_timeout))


def raise_open_files_limit(limits: ServerLimits) -> None:
    """Lift the soft limit on open files to the hard one (as vLLM does): the default 1024 is below what
    max_connections plus the model's own files may need. Warn when even the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d: %s", soft, exc)
    if soft < limits.max_connections + 128:
        logger.warning(
            "the open-files limit (%d) is below --max-connections (%d) plus 128 for the server's own "
            "files; lower --max-connections or raise `ulimit -n`",
            soft,
            limits.max_connections,
        )
