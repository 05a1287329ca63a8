"""The shared KV tier on a real Redis server (tests/kv_store.py): names, values and every way the store can fail.

Each case is a miss and a recompute with its cause counted, never a wrong payload and never an exception: another
manifest's value, a value cut short or changed, a store restarted empty, one that refuses writes (full), one that
stops answering (a step never waits on its writes), one that is down and comes back.
"""

from __future__ import annotations

import os
import threading

import pytest
import redis

from prefixkv.kvcache.offload.chained_tier import ChainedTier, shared_store
from prefixkv.kvcache.offload.host_tier import HostTier
from prefixkv.kvcache.offload.remote_tier import RedisTier, encode_value, manifest_digest
from prefixkv.kvcache.offload.tier import TierManifest
from prefixkv.kvcache.offload.writer import TierWriter
from tests.kv_store import start_store

MANIFEST = TierManifest("a" * 32, "bfloat16", 32, 1024, "sha256")
OTHER_MODEL = TierManifest("b" * 32, "bfloat16", 32, 1024, "sha256")
OTHER_BUILD = TierManifest("a" * 32, "bfloat16", 32, 1024, "sha256", kernels="matmul amx")


def chunk(seed: int) -> tuple[bytes, bytes]:
    rng = __import__("random").Random(seed)
    return rng.randbytes(32), rng.randbytes(MANIFEST.payload_bytes)


def raw(store) -> redis.Redis:
    return redis.Redis.from_url(store.url)


def test_replicas_share_names_and_a_chunk_is_stored_once(redis_store):
    a, b = RedisTier(redis_store.url, MANIFEST), RedisTier(redis_store.url, MANIFEST)
    key, payload = chunk(1)
    assert not b.contains(key) and b.get(key) is None and b.stats.misses == 1
    a.put(key, payload)
    assert b.contains(key) and b.get(key) == payload and b.stats.hits == 1
    b.put(key, payload)  # the other replica finds it: nothing is sent
    assert b.remote.already_stored == 1 and b.stats.bytes_written == 0
    assert a.stats.entries == 1 and a.stats.bytes_written == len(encode_value(a.digest, key, payload))
    assert raw(redis_store).keys("prefixkv:*") == [a._name(key)]


@pytest.mark.parametrize("other", [OTHER_MODEL, OTHER_BUILD], ids=["other model", "other kernels"])
def test_another_manifest_never_shares_a_name_and_its_value_is_a_miss(redis_store, other):
    ours, theirs = RedisTier(redis_store.url, MANIFEST), RedisTier(redis_store.url, other)
    assert ours.prefix != theirs.prefix
    key, payload = chunk(2)
    theirs.put(key, payload)
    assert not ours.contains(key) and ours.get(key) is None
    # a value of theirs under our name (a store shared by mistake, a build that changed its bits): read as a miss
    raw(redis_store).set(ours._name(key), encode_value(manifest_digest(other), key, payload))
    assert ours.get(key) is None and ours.remote.foreign == 1 and ours.stats.hits == 0


@pytest.mark.parametrize("damage", ["cut short", "a flipped bit", "another key", "empty", "not a string"])
def test_a_damaged_value_is_a_miss_counted_and_dropped_so_it_is_stored_again(redis_store, damage):
    tier = RedisTier(redis_store.url, MANIFEST)
    key, payload = chunk(3)
    tier.put(key, payload)
    name, r = tier._name(key), raw(redis_store)
    value = bytearray(r.get(name))
    if damage == "cut short":
        value = value[: len(value) // 2]
    elif damage == "a flipped bit":
        value[-100] ^= 0x10
    elif damage == "another key":
        value = bytearray(encode_value(tier.digest, chunk(4)[0], payload))
    else:
        value = bytearray()
    r.delete(name)
    if damage == "not a string":
        r.lpush(name, b"x")  # GET answers WRONGTYPE
    else:
        r.set(name, bytes(value))
    assert tier.get(key) is None and tier.stats.corrupt == 1 and not r.exists(name)
    tier.put(key, payload)
    assert tier.get(key) == payload


def test_a_store_restarted_empty_is_misses_then_filled_again(redis_store):
    tier = RedisTier(redis_store.url, MANIFEST, retry_s=0)
    key, payload = chunk(5)
    tier.put(key, payload)
    redis_store.restart()
    assert tier.get(key) is None  # gone (or the old connection found closed: a miss as well)
    assert tier.health() is None and tier.get(key) is None
    tier.put(key, payload)
    assert tier.get(key) == payload


def test_a_full_store_refuses_writes_counted_and_reads_miss():
    store = start_store(maxmemory="2mb", policy="noeviction")
    try:
        tier = RedisTier(store.url, TierManifest("a" * 32, "bfloat16", 32, 16 << 10, "sha256"))  # 512 KiB chunks
        chunks = [(os.urandom(32), os.urandom(512 << 10)) for _ in range(8)]
        for key, payload in chunks:
            tier.put(key, payload)
        assert tier.remote.refused > 0 and tier.stats.entries + tier.remote.refused == 8
        refused = [key for key, _ in chunks if not tier.contains(key)]
        assert len(refused) == tier.remote.refused and all(tier.get(key) is None for key in refused)
        assert tier.health() is None  # full is not down
    finally:
        store.__exit__()


def test_a_store_that_is_down_answers_misses_at_once_says_why_and_is_found_again(redis_store):
    clock = [0.0]
    tier = RedisTier(redis_store.url, MANIFEST, retry_s=5, clock=lambda: clock[0])
    key, payload = chunk(6)
    tier.put(key, payload)
    redis_store.stop()
    assert tier.get(key) is None and "ConnectionError" in (tier.health() or "")
    assert tier.remote.outages == 1 and tier.remote.unreachable == 1
    assert not tier.contains(key) and tier.get(key) is None
    tier.put(key, payload)
    assert tier.remote.skipped_down == 3 and tier.remote.unreachable == 1  # not tried again within retry_s
    redis_store.start()
    clock[0] = 5.0
    assert tier.health() is None  # asking after retry_s pings the store
    tier.put(key, payload)
    assert tier.get(key) == payload and tier.remote.outages == 1


def test_a_store_that_stops_answering_writes_never_holds_up_the_engine_and_drops_are_counted(redis_store):
    tier = RedisTier(redis_store.url, MANIFEST, timeout_s=60)
    writer = TierWriter(tier, max_pending=2)
    stored_key, stored = chunk(9)
    tier.put(stored_key, stored)
    r = raw(redis_store)
    r.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # reads answer, writes wait until the unpause below
    chunks = [chunk(10 + i) for i in range(10)]
    done = threading.Event()

    def submit_all():
        for key, payload in chunks:
            writer.submit(key, payload)
        done.set()

    threading.Thread(target=submit_all, daemon=True).start()
    try:
        assert done.wait(50), "a submit waited for the paused store"
        # two queued, and one in the writer's hands (its SET waits) unless the queue filled before it took one
        assert writer.dropped in (len(chunks) - 3, len(chunks) - 2)
        assert tier.get(stored_key) == stored  # reads are still served
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    writer.close()
    kept = len(chunks) - writer.dropped
    assert writer.written == kept and all(tier.get(key) == payload for key, payload in chunks[:kept])


def test_a_local_tier_in_front_keeps_what_the_store_served(redis_store):
    a = ChainedTier(HostTier(8 << 20, MANIFEST), RedisTier(redis_store.url, MANIFEST))
    b = ChainedTier(HostTier(8 << 20, MANIFEST), RedisTier(redis_store.url, MANIFEST))
    key, payload = chunk(7)
    a.put(key, payload)
    assert a.local.contains(key) and b.contains(key) and not b.local.contains(key)
    assert b.get(key) == payload and b.store_hits == 1 and b.local.contains(key)
    assert b.get(key) == payload and b.store_hits == 1  # the second read is local
    assert shared_store(b) is b.store and shared_store(b.local) is None
    with pytest.raises(ValueError, match="disagree"):
        ChainedTier(HostTier(8 << 20, OTHER_MODEL), RedisTier(redis_store.url, MANIFEST))


def test_a_bad_url_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="kv_remote"):
        RedisTier("http://127.0.0.1:1", MANIFEST)
