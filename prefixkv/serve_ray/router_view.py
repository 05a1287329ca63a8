"""What the request routers of this process send and would route on: one count of requests in flight per replica,
shared by every router of the process, and their views for the ingress's stats endpoint.

Why shared: Ray makes a request router per deployment handle, and the ingress has two (plain calls, streams). A
router that counted only its own sends would not see the streams the other one sent, and the replicas' polled
gauges lag by up to their polling period, so a replica busy with long streams would look idle to plain requests.
Why streams are counted apart: Ray reports a streaming call completed once its replica has accepted it (a
fraction of a second, while the answer streams on for as long as it takes), so the ingress counts a stream open
from its head to its last chunk itself (stream_opened / stream_closed).
Why here and not in request_router.py: Ray pickles the request router's module by value, so each router sees its
own copy of that module's globals, while this module is imported by reference, the one copy they share.
A test, or an operator, can wait on the routers' view instead of guessing when the gauges have caught up.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Protocol


class _Viewable(Protocol):
    def view(self) -> dict[str, dict[str, Any]]: ...


_ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()  # the live request routers of this process
_IN_FLIGHT: Counter[str] = Counter()  # replica id -> requests any router of this process sent there, not completed
_STREAMS: Counter[str] = Counter()  # replica id -> streams the ingress is passing on from there


def register(router: _Viewable) -> None:
    _ROUTERS.add(router)


def sent(replica_id: str) -> None:
    _IN_FLIGHT[replica_id] += 1


def completed(replica_id: str) -> None:
    if _IN_FLIGHT[replica_id] > 0:
        _IN_FLIGHT[replica_id] -= 1


def stream_opened(replica_id: str) -> None:
    _STREAMS[replica_id] += 1


def stream_closed(replica_id: str) -> None:
    if _STREAMS[replica_id] > 0:
        _STREAMS[replica_id] -= 1


def forget(replica_id: str) -> None:
    """A replica that died: what was in flight there is gone with it."""
    _IN_FLIGHT.pop(replica_id, None)
    _STREAMS.pop(replica_id, None)


def in_flight(replica_id: str) -> int:
    """Requests sent to the replica and not answered: plain calls by Ray's record, streams by the ingress's."""
    return _IN_FLIGHT.get(replica_id, 0) + _STREAMS.get(replica_id, 0)


def routers_view() -> list[dict[str, dict[str, Any]]]:
    """Per request router of this process, replica id -> the state it would route on now."""
    return [router.view() for router in list(_ROUTERS)]
