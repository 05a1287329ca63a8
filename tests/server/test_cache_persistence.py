"""/v1/caches entries across a restart on a disk KV tier (server/cache_store_file.py): the real app around an engine
on a tier directory is stopped and built again around a fresh engine (the suite's shared weights) on the same
directory; the entries come back by name for their owner only, without the deleted and the expired ones, and
the first use finds the prefix on disk. A torn or foreign file stops a refusing server and is dropped by an
ignoring one; a bearer-string owner is written only as its hash."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from datetime import datetime
from types import SimpleNamespace

import httpx
import pytest

from prefixkv.server.app import build_app
from prefixkv.server.auth import salt_prefix
from prefixkv.server.cache_store import CacheEntry, CacheStore, owner_label
from prefixkv.server.cache_store_file import (
    FILE_NAME,
    CacheEntriesFileError,
    CacheStoreFile,
    open_cache_store,
    read_entries,
)
from tests.server.live_server import running_server

KEYS = "alice-key alice\nbob-key bob\n"
# a 4,096-token pool retaining 10%, behind a disk tier of 32-token chunks (1.5 MB each in fp32)
ENGINE = dict(kv_cache_tokens=4096, retained_pool_fraction=0.1, kv_offload_size=64 << 20, kv_offload_chunk_tokens=32)


def call(base: str, method: str, path: str, key: str = "alice-key", **kw) -> httpx.Response:
    return httpx.request(method, base + path, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kw)


def create(base: str, **body) -> dict:
    system = f"[{uuid.uuid4().hex[:8]}] You are terse. " + " ".join(f"Rule {i}." for i in range(20))
    r = call(base, "POST", "/v1/caches", json={"messages": [{"role": "system", "content": system}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(base: str, name: str, key: str = "alice-key") -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "cached_content": name}
    return call(base, "POST", "/v1/chat/completions", key, json=body)


def test_entries_come_back_by_name_after_a_restart_on_the_same_disk_tier(new_engine, tmp_path):
    keys, tier = tmp_path / "keys.txt", tmp_path / "kv"
    keys.write_text(KEYS)
    with running_server(new_engine(kv_offload_dir=str(tier), **ENGINE), api_key_file=str(keys)) as (base, _, _):
        kept = create(base, ttl="300s", display_name="rules")
        kept = call(base, "PATCH", "/v1/caches/" + kept["id"], json={"ttl": "600s"}).json()  # a new expiry
        deleted = create(base, ttl="300s")
        assert call(base, "DELETE", "/v1/caches/" + deleted["name"]).status_code == 200
        expiring = create(base, ttl="1s")
    # the server stopped (a clean shutdown writes what is left) and its engine let the directory go
    assert [row["id"] for row in json.loads((tier / FILE_NAME).read_text())["entries"]] == [kept["id"], expiring["id"]]
    time.sleep(max(0.0, datetime.fromisoformat(expiring["expire_time"]).timestamp() - time.time()))

    engine = new_engine(kv_offload_dir=str(tier), **ENGINE)
    with running_server(engine, api_key_file=str(keys)) as (base, engine, _):
        rows = call(base, "GET", "/v1/caches").json()["data"]
        assert [row["id"] for row in rows] == [kept["id"]]  # not the deleted one, not the expired one
        again = call(base, "GET", "/v1/caches/" + kept["name"]).json()
        same = ("name", "display_name", "kind", "model", "create_time", "update_time", "expire_time")
        assert {k: again[k] for k in same} == {k: kept[k] for k in same}
        assert again["usage"]["total_tokens"] == kept["usage"]["total_tokens"]
        assert call(base, "GET", "/v1/caches/" + expiring["id"]).status_code == 404

        assert call(base, "GET", "/v1/caches/" + kept["id"], "bob-key").status_code == 404  # still alice's only
        assert call(base, "GET", "/v1/caches", "bob-key").json()["data"] == []
        r = chat(base, kept["name"], "bob-key")
        assert r.status_code == 400 and r.json()["error"]["code"] == "cached_content_not_found"

        r = chat(base, kept["name"])
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] > kept["usage"]["total_tokens"]
        whole_chunks = kept["usage"]["total_tokens"] // 32 * 32
        assert usage["prompt_tokens_details"]["cached_tokens"] >= whole_chunks > 0  # the entry's KV, from disk
        assert engine.get_stats().kv_tier_hit_tokens >= whole_chunks
    rows = json.loads((tier / FILE_NAME).read_text())["entries"]  # rewritten without what was left out at start
    assert [row["id"] for row in rows] == [kept["id"]] and rows[0]["owner"] == "tenant:alice"


def test_a_torn_or_foreign_file_stops_a_refusing_server_and_an_ignoring_one_starts_empty(new_engine, tmp_path, caplog):
    tier = tmp_path / "kv"
    path = tier / FILE_NAME
    engine = new_engine(kv_offload_dir=str(tier), **ENGINE)
    assert engine.tier_directory is not None and engine.tier_directory.path == str(tier)
    path.write_text('{"format": "prefixkv-cache-entries", "format_version": 1, "entr')  # torn
    with pytest.raises(CacheEntriesFileError, match=re.escape(f"{path} is unreadable")):
        build_app(engine)
    foreign = {"kv_tier": {**engine.tier_directory.manifest, "model_digest": "0" * 32}, "tokenizer": "x"}
    store = CacheStore()
    store.add(entry("cache_a", "tenant:alice", time.time() + 600))
    CacheStoreFile(path, foreign, store).write()
    with pytest.raises(CacheEntriesFileError, match=r"another model.*kv_tier\.model_digest: .* != '0000.*tokenizer"):
        build_app(engine)
    engine.close()

    ignoring = new_engine(kv_offload_dir=str(tier), kv_offload_on_mismatch="ignore", **ENGINE)
    with caplog.at_level(logging.WARNING, logger="prefixkv.server.cache_store_file"):
        assert len(build_app(ignoring).state.server.caches) == 0
        assert "model_digest" in caplog.text and "starting without its entries" in caplog.text
        path.write_text("\0\0\0")
        assert len(build_app(ignoring).state.server.caches) == 0
        assert "is unreadable" in caplog.text
    ignoring.close()
    # without a disk tier (none, a host tier, an ignored directory): nothing is read or written
    assert open_cache_store(SimpleNamespace(tier_directory=None), "m")[1] is None


def entry(entry_id: str, owner: str | None, expire_time: float) -> CacheEntry:
    now = time.time()
    return CacheEntry(entry_id, owner, "salt", "prompt", (1, 2, 3), (), "m", None, now, now, expire_time)


def test_the_file_keeps_ids_order_and_owners_but_no_bearer_token(tmp_path):
    now = time.time()
    store = CacheStore()
    for e in (entry("cache_a", "bearer:secret-token", now + 600), entry("cache_b", None, now + 600)):
        store.add(e)
    identity = {"kv_tier": {"model_digest": "d"}, "tokenizer": "t"}
    path = tmp_path / FILE_NAME
    CacheStoreFile(path, identity, store).write()
    assert "secret-token" not in path.read_text()

    back = CacheStore(max_per_owner=1)
    expired, over = entry("cache_c", None, now - 1), entry("cache_d", None, now + 600)
    over.seq = 5
    left_out = back.restore([*read_entries(path, identity), expired, over])
    assert [e.id for e in left_out] == ["cache_c", "cache_d"]  # expired; past the one-per-owner bound
    assert back.get("cache_a", "bearer:secret-token") is not None and back.get("cache_a", "bearer:other") is None
    assert owner_label(back.get("cache_a", None, admin=True).owner) == "bearer:" + salt_prefix("bearer:secret-token")
    assert back.add(entry("cache_e", "tenant:x", now + 600)).seq == 3  # after the restored ones: page tokens hold
    with pytest.raises(CacheEntriesFileError, match="tokenizer: 'other' != 't'"):
        read_entries(path, {**identity, "tokenizer": "other"})
