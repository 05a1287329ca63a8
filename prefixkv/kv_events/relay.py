"""KV events' part in every engine step: what the cache stored and evicted, published once a step.

The KV manager buffers its events (enable_events()); EventRelay drains that buffer after each step and after a
cache reset and hands the batch to the publisher, as a step component of the engine core
(prefixkv/engine/core.py). Built in the composition root (prefixkv.llm); the engine sees it only as a component.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.request import Request

if TYPE_CHECKING:  # pyzmq is needed only once events are published
    from prefixkv.kv_events.publisher import ZmqEventPublisher


class EventRelay:
    def __init__(self, kv: KVCacheManager, publisher: ZmqEventPublisher) -> None:
        """Turns on kv's event buffer; owns the publisher from here and closes it in close()."""
        self.kv, self.publisher = kv, publisher
        kv.enable_events()
        self.closed = False

    def on_add(self, request: Request) -> None:
        pass

    def before_execute(self, scheduled: object) -> None:
        pass

    def after_update(self, scheduled: object) -> None:
        self.publish()

    def after_outputs(self) -> None:
        pass

    def on_reset(self) -> None:
        self.publish()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.publish()
            self.publisher.close()
            self.closed = True

    def stats(self) -> dict[str, Any]:
        return {"kv_events_endpoint": self.publisher.endpoint}

    def publish(self) -> None:
        """One batch of what the cache stored and evicted since the last one (none when nothing changed)."""
        events = self.kv.drain_events()
        if events and not self.closed:
            self.publisher.publish(events)
