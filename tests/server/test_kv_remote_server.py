"""`prefixkv serve --kv-remote URL` with its store going away: requests keep being answered (recomputed), /health
says degraded and why, /metrics says the store is down, the log says it once; the store back, all is ok again."""

from __future__ import annotations

import logging

import httpx

from tests.server.live_server import metric_samples, running_server

BODY = {"prompt": "The harbour at dawn: gulls, nets, and " * 8, "max_tokens": 2, "temperature": 0}


def test_the_server_serves_on_without_its_store_and_says_so(new_engine, redis_store, caplog):
    engine = new_engine(kv_remote=redis_store.url, kv_remote_timeout=0.5, kv_offload_chunk_tokens=32)
    store = engine.kv.tier
    store.retry_s = 0.0  # ask the store again at every call: the test sees it come back at once
    body = {**BODY, "model": engine.model_name}
    with running_server(engine) as (base, _, _):
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        first = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        redis_store.stop()
        with caplog.at_level(logging.WARNING, logger="prefixkv.kvcache.offload.remote_tier"):
            again = httpx.post(base + "/v1/completions", json={**body, "prompt": BODY["prompt"] + "x"}, timeout=120)
            assert again.status_code == 200
            health = httpx.get(base + "/health").json()
        assert health["status"] == "degraded" and "ConnectionError" in health["kv_remote"]
        assert any("unreachable" in record.getMessage() for record in caplog.records)
        samples = metric_samples(base, {})
        name = engine.model_name
        up, outages = (
            f'prefixkv:kv_remote_up{{model_name="{name}"}}',
            f'prefixkv:kv_remote_outages_total{{model_name="{name}"}}',
        )
        assert samples[up] == 0.0 and samples[outages] >= 1
        redis_store.start()
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        repeat = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert repeat == first
