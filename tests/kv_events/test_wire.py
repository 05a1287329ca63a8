"""The event wire, checked from the outside: frames read off real ZeroMQ sockets and payloads decoded with the
plain `msgpack` package, following the layout documented in prefixkv/kv_events/wire.py (not prefixkv's own
decoder), for both formats; and a subscriber that misses batches notices from the sequence numbers and catches up
through the replay socket."""

import random

import msgpack
import msgspec
import pytest
import zmq

from prefixkv.kv_events.publisher import END_OF_REPLAY, ZmqEventPublisher
from prefixkv.kv_events.subscriber import KVEventSubscriber
from prefixkv.kv_events.wire import BatchEncoder
from prefixkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, apply_events
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from tests.kvcache.helpers import admit, compute, make_request

LOCAL = "tcp://127.0.0.1:*"
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
STORED_OPTIONAL = ["extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]


def decode_vllm(payload: bytes) -> tuple[float, list, int]:
    """Batch [ts, events, rank]; events maps tagged by "type", optional fields only when set."""
    ts, raw_events, rank = msgpack.unpackb(payload)
    events = []
    for raw in raw_events:
        kind = raw.pop("type")
        if kind == "BlockStored":
            assert list(raw)[: len(STORED_FIELDS)] == STORED_FIELDS  # declaration order, always present
            assert set(raw) <= set(STORED_FIELDS + STORED_OPTIONAL)
            if raw.get("extra_keys") is not None:
                raw["extra_keys"] = [tuple(k) if k is not None else None for k in raw["extra_keys"]]
            events.append(BlockStored(**raw))
        elif kind == "BlockRemoved":
            assert list(raw)[:2] == ["block_hashes", "medium"]
            events.append(BlockRemoved(**raw))
        else:
            assert kind == "AllBlocksCleared" and raw == {}
            events.append(AllBlocksCleared())
    return ts, events, rank


def decode_array(payload: bytes) -> tuple[float, list, int]:
    """Batch [ts, events, rank]; events arrays [tag, fields...] of the older releases."""
    ts, raw_events, rank = msgpack.unpackb(payload)
    events = []
    for raw in raw_events:
        if raw[0] == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium = raw
            events.append(BlockStored(hashes, parent, tokens, block_size, lora_id, medium))
        elif raw[0] == "BlockRemoved":
            _, hashes, medium = raw
            events.append(BlockRemoved(hashes, medium))
        else:
            assert raw == ["AllBlocksCleared"]
            events.append(AllBlocksCleared())
    return ts, events, rank


def older_fields(event):
    """What the array layout carries of an event: the older releases' fields only."""
    if isinstance(event, BlockStored):
        e = event
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium)
    if isinstance(event, BlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return event


def workload(kv, seed=0):
    """Endless steps of a small workload with tenants and evictions; yields each step's events."""
    rng = random.Random(seed)
    prefixes = [list(range(100, 124)), list(range(300, 316))]
    while True:
        tokens = rng.choice(prefixes)[: rng.randint(4, 24)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
        req = make_request(tokens or [1], cache_salt=rng.choice([None, "a"]))
        if admit(kv, req):
            compute(kv, req)
        kv.free(req)
        if rng.random() < 0.1:
            kv.reset_prefix_cache(rng.choice([None, lambda s: s == "a"]))
        events = kv.drain_events()
        if events:
            yield events


def small_cache(kind):
    kv = HashPrefixCache(10, 4) if kind == "hash" else RadixPrefixCache(10, 4)
    kv.enable_events()
    return kv


def join(sub, publisher, steps, timeout_s=10.0):
    """Publish steps until the subscriber (connecting: ZeroMQ subscriptions take a moment) gets one, then read
    what is still in flight, so the next message it gets is the next one published."""
    poll_ms, last = 20, -1
    for _ in range(int(timeout_s * 1000 / poll_ms)):
        last = publisher.publish(next(steps))
        if sub.poll(poll_ms):
            break
    else:
        raise AssertionError("no message arrived")
    while int.from_bytes(sub.recv_multipart()[1], "big") < last:
        assert sub.poll(5000), "a published batch did not arrive"


@pytest.mark.parametrize(("fmt", "decode"), [("vllm", decode_vllm), ("array", decode_array)])
def test_frames_decode_with_an_independent_decoder(fmt, decode):
    ctx = zmq.Context.instance()
    publisher = ZmqEventPublisher(LOCAL, topic="kv@replica-0", fmt=fmt, context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.endpoint)
    try:
        kv = small_cache("hash")
        steps = workload(kv)
        join(sub, publisher, steps)
        seen = 0
        while seen < 40:  # enough batches to hold every kind of event
            events = next(steps)
            seq = publisher.publish(events, ts=123.5)
            assert sub.poll(5000), "a published batch did not arrive"
            topic, seq_frame, payload = sub.recv_multipart()
            assert topic == b"kv@replica-0" and len(seq_frame) == 8 and int.from_bytes(seq_frame, "big") == seq
            ts, decoded, rank = decode(payload)
            assert (ts, rank) == (123.5, 0)
            if fmt == "array":
                events = [older_fields(e) for e in events]
            assert decoded == events
            seen += 1
    finally:
        sub.close(linger=0)
        publisher.close()


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_missed_batches_are_detected_and_replayed(kind):
    """A subscriber that joins late, and one that loses batches while disconnected, both end with exactly the
    cache's blocks: each gap is noticed from the sequence numbers and filled from the replay socket."""
    ctx = zmq.Context.instance()
    publisher = ZmqEventPublisher(LOCAL, LOCAL, topic="kv", context=ctx)
    kv = small_cache(kind)
    steps = workload(kv, seed=1)
    last = -1
    for _ in range(5):  # published before anyone listens
        last = publisher.publish(next(steps))
    assert publisher.wait_sent(last)
    view: set[int] = set()

    def catch_up(sub):
        """Publish until the subscriber (joining: ZeroMQ subscriptions take a moment) hears something, then read
        up to the last published batch."""
        nonlocal last
        start = sub.last_seq
        while sub.last_seq == start:
            last = publisher.publish(next(steps))
            for _, _, events in sub.receive(timeout=0.02):
                apply_events(view, events)
        while sub.last_seq < last:
            batches = sub.receive(timeout=5.0)
            assert batches, "a published batch did not arrive"
            for _, _, events in batches:
                apply_events(view, events)

    try:
        sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv", context=ctx)
        catch_up(sub)
        assert (sub.gaps, sub.lost) == (1, 0)  # batches 0..4 came through the replay socket
        assert view == kv.cached_block_hashes()
        seen_before = sub.last_seq
        sub.close()
        for _ in range(3):  # missed: nobody is connected
            last = publisher.publish(next(steps))
        assert publisher.wait_sent(last)
        sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv", context=ctx)
        sub.last_seq = seen_before  # the same router, reconnecting with its view
        catch_up(sub)
        assert (sub.gaps, sub.lost) == (1, 0)
        assert view == kv.cached_block_hashes()
    finally:
        sub.close()
        publisher.close()


def test_array_layout_decodes_with_the_oldest_struct_definitions():
    """The first vLLM releases with KV events declared fewer fields (BlockStored up to lora_id, BlockRemoved only
    its hashes, a batch of [ts, events]); msgspec decoders of those array-like structs ignore the trailing
    fields the array layout adds, so they read prefixkv's payloads."""

    class Event(msgspec.Struct, array_like=True, tag=True):
        pass

    class Stored(Event, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class Removed(Event, tag="BlockRemoved"):
        block_hashes: list[int]

    class Cleared(Event, tag="AllBlocksCleared"):
        pass

    class Batch(msgspec.Struct, array_like=True):
        ts: float
        events: list[Stored | Removed | Cleared]

    events = [BlockStored([1, 2], 7, [5] * 8, 4), BlockRemoved([2]), AllBlocksCleared()]
    batch = msgspec.msgpack.decode(BatchEncoder("array").encode(2.0, events), type=Batch)
    assert batch.ts == 2.0
    assert batch.events == [Stored([1, 2], 7, [5] * 8, 4, None), Removed([2]), Cleared()]


def test_replay_protocol_with_a_raw_socket():
    """vLLM's replay protocol, spoken by a bare DEALER: [b"", start] in; [b"", seq, payload] per buffered batch
    from start on, then [b"", -1, b""]."""
    ctx = zmq.Context.instance()
    publisher = ZmqEventPublisher(LOCAL, LOCAL, context=ctx, buffer_batches=3)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        for i in range(5):
            publisher.publish([BlockRemoved([i])])
        assert publisher.wait_sent(4)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while not replies or replies[-1][1] != END_OF_REPLAY:
            assert dealer.poll(5000), "the replay did not end"
            replies.append(dealer.recv_multipart())
        # the buffer keeps the last 3 batches: 2, 3, 4
        assert [int.from_bytes(f[1], "big") for f in replies[:-1]] == [2, 3, 4]
        assert all(f[0] == b"" for f in replies) and replies[-1] == [b"", END_OF_REPLAY, b""]
        assert [decode_vllm(f[2])[1] for f in replies[:-1]] == [[BlockRemoved([i])] for i in (2, 3, 4)]
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_options_are_checked_and_generate_flags():
    import argparse

    from prefixkv.config import EngineConfig
    from prefixkv.engine_args import add_engine_args, engine_kwargs

    for bad, field in (
        ({"kv_events_format": "json"}, "kv_events_format"),
        ({"kv_events_endpoint": "localhost:5557"}, "kv_events_endpoint"),
        ({"kv_events_replay_endpoint": "tcp://*:5558"}, "kv_events_replay_endpoint"),
    ):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv", "--kv-events-format", "array"]
    )
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (config.kv_events_endpoint, config.kv_events_topic, config.kv_events_format) == (
        "tcp://*:5557",
        "kv",
        "array",
    )
    assert config.kv_events_replay_endpoint is None


def test_an_unusable_address_fails_at_startup(tmp_path):
    with pytest.raises(ValueError, match="cannot bind"):
        ZmqEventPublisher(f"ipc://{tmp_path}/missing-dir/events")
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/events")  # ipc works too
    publisher.close()
