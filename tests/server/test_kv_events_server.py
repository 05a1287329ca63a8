"""KV events from a real engine behind the real server: a router-side subscriber follows the radix cache's pages
(named by the hash chain, so prompt_block_hashes finds a prompt's pages), /load and /metrics report the gauges a
router scores on, and a full cache reset arrives as AllBlocksCleared."""

from __future__ import annotations

import httpx
import openai

from prefixkv.kv_events.relay import EventRelay
from prefixkv.kv_events.subscriber import KVEventSubscriber
from prefixkv.kvcache.events import AllBlocksCleared, apply_events
from prefixkv.kvcache.hashing import prompt_block_hashes
from tests.server.live_server import running_server

LOCAL = "tcp://127.0.0.1:*"
PROMPT = list(range(1000, 1040))  # token ids: what the cache keys on, exactly


def test_engine_publishes_kv_events_and_load(new_engine):
    engine = new_engine(
        prefix_cache="radix",
        page_size=4,
        kv_cache_tokens=256,
        kv_events_endpoint=LOCAL,
        kv_events_replay_endpoint=LOCAL,
        kv_events_topic="kv",
    )
    (relay,) = [c for c in engine.components if isinstance(c, EventRelay)]
    publisher = relay.publisher
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv")
    view: set[int] = set()
    try:
        with running_server(engine) as (base, _, _):
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
            client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=3, temperature=0)
            cached = engine.kv.cached_block_hashes()  # the engine thread is idle now
            assert set(prompt_block_hashes(PROMPT, 4)) <= cached

            load = httpx.get(base + "/load").json()
            assert load["num_requests_waiting"] == load["num_requests_running"] == 0
            assert load["num_cached_pages"] == len(cached) and load["page_size"] == 4
            assert load["kv_events_endpoint"] == publisher.endpoint
            assert 0 <= load["kv_cache_usage"] <= 1
            assert f'prefixkv:prefix_cache_cached_pages{{model_name="{engine.model_name}"}} {len(cached)}.0' in (
                httpx.get(base + "/metrics").text
            )

            assert httpx.post(base + "/reset_prefix_cache").json()["reset"] is True
            before_clear = None
            while before_clear is None:
                batches = sub.receive(timeout=10.0)
                assert batches, "the reset's batch did not arrive"
                for _, _, events in batches:
                    if events == [AllBlocksCleared()]:
                        before_clear = set(view)
                    apply_events(view, events)
            assert before_clear == cached  # missed batches (ZeroMQ's late join) were replayed
            assert view == set() == engine.kv.cached_block_hashes()
    finally:
        sub.close()
        engine.close()
