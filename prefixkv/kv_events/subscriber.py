"""A KV event subscriber that never silently diverges: it follows the sequence numbers, and when one is skipped
(a slow joiner, a dropped message, a restart) it asks the publisher's replay socket for what it missed before
it applies anything newer.

Used by routers (and tests) to keep a per-replica view of cached blocks. receive() hands over the batches in
sequence order; a gap the replay buffer no longer covers is reported (`lost` counts those batches), after which
the view should be rebuilt (e.g. treat the replica as empty).
"""

from __future__ import annotations

import zmq

from prefixkv.kv_events.publisher import END_OF_REPLAY
from prefixkv.kv_events.wire import BatchDecoder
from prefixkv.kvcache.events import KVCacheEvent


class KVEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        fmt: str = "vllm",
        replay_timeout: float = 2.0,
        context: zmq.Context | None = None,
    ) -> None:
        """endpoint: the publisher's PUB address (connected to); replay_endpoint: its ROUTER address."""
        ctx = context or zmq.Context.instance()
        self._decoder = BatchDecoder(fmt)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.replay_timeout = replay_timeout
        self.last_seq = -1  # the last batch applied
        self.gaps = 0  # gaps seen
        self.lost = 0  # batches no replay could bring back

    def receive(self, timeout: float) -> list[tuple[int, float, list[KVCacheEvent]]]:
        """Wait up to `timeout` seconds for the next message; return the batches it makes applicable, in order
        ([] on timeout): the replayed ones it revealed were missed, then its own."""
        if not self._sub.poll(int(timeout * 1000)):
            return []
        _, seq_frame, payload = self._sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        out: list[tuple[int, float, list[KVCacheEvent]]] = []
        if seq <= self.last_seq:
            return out  # already applied (replayed)
        if seq > self.last_seq + 1:
            self.gaps += 1
            out.extend(self._replay_from(self.last_seq + 1, seq))
            if self.last_seq + 1 < seq:
                self.lost += seq - self.last_seq - 1
        ts, events, _ = self._decoder.decode(payload)
        out.append((seq, ts, events))
        self.last_seq = seq
        return out

    def _replay_from(self, start: int, stop: int) -> list[tuple[int, float, list[KVCacheEvent]]]:
        """Batches start .. stop - 1 from the replay socket, as far as they come in order."""
        if self._replay is None:
            return []
        while self._replay.poll(0):  # late answers to an earlier request that timed out
            self._replay.recv_multipart()
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while self._replay.poll(int(self.replay_timeout * 1000)):
            frames = self._replay.recv_multipart()
            seq_frame, payload = frames[-2], frames[-1]
            if seq_frame == END_OF_REPLAY:
                break
            seq = int.from_bytes(seq_frame, "big")
            if seq == self.last_seq + 1 and seq < stop:
                ts, events, _ = self._decoder.decode(payload)
                out.append((seq, ts, events))
                self.last_seq = seq
        return out

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
