"""The real store the shared KV tier's tests run against: Debian's redis-server (scripts/setup.sh installs it),
started on a free port by the `redis_store` fixture and stopped after. Without it the tests are skipped on a
developer's machine and fail in CI (`CI=true`), where a skip would hide every check of the shared tier.
"""

from __future__ import annotations

import os

import pytest

from prefixkv.kvcache.offload.store_process import RedisServer, redis_server_binary


def start_store(**options) -> RedisServer:
    """A started RedisServer (options: maxmemory, policy); skips (or fails under CI=true) without redis-server."""
    if redis_server_binary() is None:
        message = "redis-server is not installed (scripts/setup.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + ": CI must provide it")
        pytest.skip(message)
    return RedisServer(**options).start()


@pytest.fixture
def redis_store():
    """A fresh, empty redis-server for one test (a few ms to start): stopped, restarted or filled at will."""
    store = start_store()
    yield store
    store.__exit__()
