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

    # tenants: a chunk stored under one cache salt is never found under another (the salt is in the chain key)
    salted = {"prompt_token_ids": a_prompt, "cache_salt": "tenant-1"}
    assert a.generate(salted, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    a.llm_engine.flush()
    other = b.generate({**salted, "cache_salt": "tenant-2"}, GREEDY, use_tqdm=False)[0]
    same = b.generate(salted, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 96

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
    out = reader.generate({"prompt_token_ids": b_prompt}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[1] and out.num_cached_tokens == 0  # computed, served
    # what the pool never held, a store might have: missed because it was down
    assert out.cache_miss.cause == "store_down" and out.cache_miss.tokens_by_cause["store_down"] > 0
    stats = reader.llm_engine.get_stats()
    assert stats.kv_remote_status.startswith("degraded") and stats.kv_remote_outages == 1
    assert stats.prefix_cache_missed_by_cause["store_down"] == out.cache_miss.tokens_by_cause["store_down"]
    reader.llm_engine.kv.check_invariants()
    text = ServerMetrics(reader.llm_engine.model_name).render(stats).decode()
    assert f'prefixkv:kv_remote_up{{model_name="{reader.llm_engine.model_name}"}} 0.0' in text
    reader.close()


def test_kv_events_say_where_a_block_can_be_loaded_from(new_llm, redis_store):
    """With KV events on, a chunk that lands in a tier is a BlockStored of its pages with the tier's medium
    (host RAM "CPU", the shared store "REMOTE") beside the pool's "GPU" ones, and a pool subscriber's view
    (events.apply_events) stays the pool's."""
    from prefixkv.kvcache.events import BlockStored, apply_events

    llm = replica(new_llm, redis_store, kv_offload_host_size=16 << 20)
    kv = llm.llm_engine.kv
    kv.enable_events()
    a_prompt, _ = prompts(llm.get_tokenizer())
    run(llm, a_prompt)
    llm.llm_engine.flush()
    events = kv.drain_events()
    by_medium: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            by_medium.setdefault(event.medium, []).extend(event.block_hashes)
    assert set(by_medium) == {"GPU", "CPU", "REMOTE"}
    assert by_medium["CPU"] == by_medium["REMOTE"] and len(by_medium["REMOTE"]) == 6  # 3 chunks of 2 pages
    assert set(by_medium["REMOTE"]) <= set(by_medium["GPU"])  # the same names as the pool's pages
    assert apply_events(set(), events) == kv.cached_block_hashes()
    llm.close()


def test_where_recomputing_is_measured_cheaper_the_store_is_not_read(new_llm, redis_store):
    """The engine times its prefill (the tier copier) and the store its reads; once a chunk read costs more than
    recomputing the chunk here, lookups skip the store (counted) and the answer is the recompute's."""
    reference = new_llm(prefix_cache="off", **POOL)
    a_prompt, b_prompt = prompts(reference.get_tokenizer())
    expected = run(reference, b_prompt)[0]
    writer, reader = replica(new_llm, redis_store), replica(new_llm, redis_store)
    run(writer, a_prompt)
    run(writer, b_prompt)
    writer.llm_engine.flush()
    assert writer.llm_engine.kv.tier.recompute_seconds_per_token > 0  # measured on its prefills
    assert run(reader, a_prompt)[1] == 96  # read from the store: its read time is measured
    store = reader.llm_engine.kv.tier
    assert store.read_seconds_per_chunk() > 0 and not store.cheaper_to_recompute()
    store.recompute_seconds_per_token = store.read_seconds_per_chunk() / 32 / 10  # as if prefill were 10x a read
    assert store.cheaper_to_recompute()
    tokens, cached = run(reader, b_prompt)  # recomputed, though the store holds it (one call in PROBE_EVERY
    assert tokens == expected and cached < 96  # still asks the store, to follow its speed)
    stats = reader.llm_engine.get_stats()
    assert stats.kv_remote_skipped_recompute_cheaper >= 1
    writer.close()
    reader.close()
