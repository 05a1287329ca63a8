"""Publishes event batches on a ZeroMQ PUB socket, with an optional ROUTER socket that replays recent batches.

The engine thread calls publish() once a step; it only numbers the batch and queues it, so a step never waits on
the network. A background thread owns both sockets: it encodes each batch, sends [topic, sequence number,
payload] (PUB drops messages no subscriber is there to take, and drops rather than blocks past its high-water
mark), keeps the last `buffer_batches` payloads, and answers replay requests. Errors there are logged, never
raised into the engine.

Replay protocol (vLLM's): a client (DEALER, or REQ for its first reply) sends the first sequence number it wants
as 8 bytes big-endian; the ROUTER sends back, for every buffered batch from there on, [sequence number, payload],
then the end marker [-1 as 8 signed big-endian bytes, empty payload]. With a DEALER the replies come with the
empty delimiter frame first, as a REQ socket would expect: [b"", sequence, payload].

Endpoints follow vLLM's convention: one with a wildcard (tcp://*:5557, tcp://127.0.0.1:*), ipc:// or inproc:// is
bound, any other tcp:// address is connected to (a subscriber that binds). The replay endpoint is always bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from prefixkv.kv_events.wire import BatchEncoder
from prefixkv.kvcache.events import KVCacheEvent

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_BATCHES = 10_000  # replayable history: at one batch per step, a few minutes of a busy engine
_STOP = object()
_REPLAY_POLL_SECONDS = 0.05  # how long the thread waits for a batch before it looks at replay requests again


def should_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        fmt: str = "vllm",
        data_parallel_rank: int = 0,
        buffer_batches: int = DEFAULT_BUFFER_BATCHES,
        hwm: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        """Binds (or connects) now, so a bad or busy address fails at startup (ValueError)."""
        self._encoder = BatchEncoder(fmt)
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (seq, ts, events); unbounded: put never blocks
        self._next_seq = 0
        self.sent_seq = -1  # the last batch handed to the PUB socket (written by the publisher thread)
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = self._attach(self._pub, endpoint, bind=should_bind(endpoint))
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._attach(self._replay, replay_endpoint, bind=True)
        except ValueError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="prefixkv-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
        """Bind or connect; returns the address actually used (a wildcard port resolved)."""
        try:
            if bind:
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            raise ValueError(f"KV events: cannot {'bind' if bind else 'connect'} {endpoint!r}: {exc}") from exc

    # -- the engine thread ---------------------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> int:
        """Queue one batch; returns its sequence number (numbered here, so order is the engine's)."""
        seq = self._next_seq
        self._next_seq += 1
        self._queue.put((seq, time.time() if ts is None else ts, events))
        return seq

    def wait_sent(self, seq: int, timeout: float = 10.0) -> bool:
        """Wait until batch `seq` has been handed to the socket (tests, and a clean shutdown)."""
        deadline = time.monotonic() + timeout
        while self.sent_seq < seq and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.001)
        return self.sent_seq >= seq

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread (it closes the sockets)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    # -- the publisher thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        wait = _REPLAY_POLL_SECONDS if self._replay is not None else None
        try:
            while True:
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if item is not None:
                    self._send(*item)
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
        finally:
            self._close_sockets()

    def _send(self, seq: int, ts: float, events: list[KVCacheEvent]) -> None:
        try:
            payload = self._encoder.encode(ts, events, self.data_parallel_rank)
            self._buffer.append((seq, payload))  # before sending: a subscriber that saw it can replay it
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent_seq = seq
        except zmq.Again:
            pass  # past the high-water mark: dropped, as PUB does; subscribers see the gap and replay
        except Exception:
            logger.exception("KV events: publishing batch %d failed", seq)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        try:
            frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            if len(frames) == 3 and not frames[1]:  # [identity, b"", start] from REQ or a DEALER that adds b""
                start_frame, head = frames[2], [frames[0], b""]
            elif len(frames) == 2:  # [identity, start] from a DEALER
                start_frame, head = frames[1], [frames[0]]
            else:
                logger.warning("KV events: ignored a replay request of %d frames", len(frames))
                return
            if len(start_frame) != 8:
                logger.warning("KV events: ignored a replay request whose start is not 8 bytes")
                return
            start = int.from_bytes(start_frame, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([*head, END_OF_REPLAY, b""])
        except Exception:
            logger.exception("KV events: a replay request failed")

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
