"""The shared KV tier on the real model (fp32, greedy) and a real Redis server: two engines on one store stand for
two replicas. What one computed, the other loads instead of recomputing, with the same tokens as a recompute; the
store failing (down, damaged values) costs recomputes, counted, never a request or a wrong token.

Pages of 16 tokens, chunks of 32 (as tests/engine/test_kv_offload.py).
"""

from __future__ import annotations

import redis

from prefixkv.sampling_params import SamplingParams
from prefixkv.server.metrics import ServerMetrics
from tests.engine.test_kv_offload import POOL, prompts, run

GREEDY = SamplingParams(temperature=0, max_tokens=2)


def replica(new_llm, store, **options):
    return new_llm(prefix_cache="hash", **POOL, kv_remote=store.url, kv_offload_chunk_tokens=32, **options)


def test_a_prefix_one_replica_computed_is_served_by_the_other_from_the_store(new_llm, redis_store):
    reference = new_llm(prefix_cache="off", **POOL)
    a_prompt, _ = prompts(reference.get_tokenizer())
    expected = run(reference, a_prompt)[0]
    a = replica(new_llm, redis_store)
    assert run(a, a_prompt) == (expected, 0)
    a.llm_engine.flush()  # the writer thread stores a's chunks
    stored = a.llm_engine.get_stats()
    assert stored.kv_tier == "remote" and stored.kv_remote_stored == 3 and stored.kv_remote_status == "ok"

    b = replica(new_llm, redis_store, debug_nan_kv=True)
    assert run(b, a_prompt) == (expected, 96)  # every full chunk below the last token, from the store
    stats = b.llm_engine.get_stats()
    assert stats.kv_tier_hit_tokens == 96 and stats.kv_remote_hits == 3 and stats.kv_remote_stored == 0
    b.llm_engine.kv.check_invariants()
    text = ServerMetrics(b.llm_engine.model_name).render(stats).decode()
    name = b.llm_engine.model_name
    assert f'prefixkv:kv_remote_chunks_total{{model_name="{name}",outcome="hit"}} 3.0' in text
    assert f'prefixkv:kv_remote_up{{model_name="{name}"}} 1.0' in text

    # a local tier in front: b's second engine keeps what the store served, and a third read is local
    c = replica(new_llm, redis_store, kv_offload_host_size=16 << 20)
    assert run(c, a_prompt) == (expected, 96)
    assert c.llm_engine.get_stats().kv_tier == "host+remote" and c.llm_engine.get_stats().kv_remote_hits == 3
    for llm in (a, b, c):
        llm.close()


def test_a_store_that_is_down_or_damaged_costs_a_recompute_counted_never_a_request(new_llm, redis_store):
    reference = new_llm(prefix_cache="off", **POOL)
    a_prompt, b_prompt = prompts(reference.get_tokenizer())
    expected = run(reference, a_prompt)[0], run(reference, b_prompt)[0]
    writer = replica(new_llm, redis_store)
    assert run(writer, a_prompt) == (expected[0], 0)
    writer.llm_engine.flush()
    writer.close()
    r = redis.Redis.from_url(redis_store.url)
    names = sorted(r.keys("prefixkv:*"))
    damaged = names[0]
    r.set(damaged, r.get(damaged)[:-1])  # one chunk cut short: the hit ends before it

    reader = replica(new_llm, redis_store)
    tokens, cached = run(reader, a_prompt)
    stats = reader.llm_engine.get_stats()
    assert tokens == expected[0] and cached in (0, 32, 64) and stats.kv_remote_corrupt == 1

    redis_store.stop()
    assert run(reader, b_prompt) == (expected[1], 0)  # the store is gone: computed, served
    stats = reader.llm_engine.get_stats()
    assert stats.kv_remote_status.startswith("degraded") and stats.kv_remote_outages == 1
    reader.llm_engine.kv.check_invariants()
    text = ServerMetrics(reader.llm_engine.model_name).render(stats).decode()
    assert f'prefixkv:kv_remote_up{{model_name="{reader.llm_engine.model_name}"}} 0.0' in text
    reader.close()
