"""The engine's one background writer into a tier: a step hands over (key, payload) pairs and goes on.

A tier write (a file, a checksum) must never lengthen a step, so the queue is bounded and a save that finds it
full is dropped and counted: a dropped save costs a later recompute, never an output.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from prefixkv.kvcache.offload.tier import KVTier

logger = logging.getLogger(__name__)

_STOP = object()


DEFAULT_PENDING_BYTES = 256 << 20


class TierWriter:
    def __init__(self, tier: KVTier, max_pending: int | None = None) -> None:
        """max_pending: payloads queued at most (default: DEFAULT_PENDING_BYTES worth, a long prompt's chunks)."""
        if max_pending is None:
            max_pending = max(1, DEFAULT_PENDING_BYTES // max(1, tier.manifest.payload_bytes))
        self.tier = tier
        self.written = 0  # chunks put into the tier
        self.dropped = 0  # saves refused because the queue was full
        self.failed = 0  # puts that raised (logged)
        self.closed = False
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name=f"prefixkv-{tier.name}-writer", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, payload: bytes, stored: Callable[[], None] | None = None) -> bool:
        """Queue a put; False when the queue is full (counted in dropped) or the writer is closed. `stored` is
        called on the writer thread once the put has returned."""
        if self.closed:
            return False
        try:
            self._queue.put_nowait((key, payload, stored))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def flush(self) -> None:
        """Wait until every queued put has been done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued puts and stop the thread (the tier itself stays open: its owner closes it)."""
        self.closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                key, payload, stored = item
                self.tier.put(key, payload)
                self.written += 1
                if stored is not None:
                    stored()
            except Exception:  # a full disk or a vanished directory must not kill the engine
                self.failed += 1
                logger.exception("KV tier %s: a chunk could not be stored", self.tier.name)
            finally:
                self._queue.task_done()
