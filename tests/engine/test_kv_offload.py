"""The KV offload tier on the real model (fp32, greedy): what comes back from the tier gives the same tokens as a
recompute, across an eviction from the pool and across a restart of the engine on a disk tier, and a damaged
entry is recomputed, never served.

Pages of 16 tokens, chunks of 32, a pool too small to hold two of the prompts: the second evicts the first.
"""

from __future__ import annotations

import pytest

from prefixkv.kvcache.hashing import hash_prompt_blocks
from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0, max_tokens=2)
POOL = dict(kv_cache_tokens=128, page_size=16, max_num_batched_tokens=512)  # 8 pages; a prompt takes 7
TIER = dict(kv_offload_host_size=64 << 20, kv_offload_chunk_tokens=32)


def prompts(tok) -> tuple[list[int], list[int]]:
    a = tok.encode("You are a careful assistant for a bicycle shop. Answer briefly and politely. " * 9)[:100]
    b = tok.encode("The history of the printing press begins in Mainz, around the year 1450. " * 9)[:100]
    return a, b


def run(llm, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.fixture(scope="module")
def reference(new_llm):
    return new_llm(prefix_cache="off", **POOL)


@pytest.fixture(scope="module")
def expected(reference):
    a, b = prompts(reference.get_tokenizer())
    return run(reference, a)[0], run(reference, b)[0]


@pytest.mark.parametrize("kind, write_policy", [("hash", "write_through"), ("radix", "write_back")])
def test_outputs_are_identical_when_an_evicted_prompt_comes_back_from_the_tier(new_llm, expected, kind, write_policy):
    llm = new_llm(prefix_cache=kind, **POOL, **TIER, kv_offload_write_policy=write_policy, debug_nan_kv=True)
    engine = llm.llm_engine
    a, b = prompts(llm.get_tokenizer())
    assert run(llm, a) == (expected[0], 0)
    assert run(llm, b) == (expected[1], 0)  # evicts a from the pool
    engine.flush()  # the writer thread may still hold a's last chunks
    tokens, cached = run(llm, a)
    assert tokens == expected[0] and cached == 96  # every full chunk below a's last token
    stats = engine.get_stats()
    assert stats.kv_tier == "host" and stats.kv_tier_hit_tokens > 0 and stats.kv_tier_loaded_bytes > 0
    # a's and b's 3 chunks; write_back saved a's when b evicted them, b's when a came back and evicted b
    assert stats.kv_tier_saved_chunks == 6
    assert 0 < stats.kv_pool_hit_tokens < 96  # the pool kept a's start
    engine.kv.check_invariants()
    text = ServerMetrics(engine.model_name).render(stats).decode()
    hits = 'prefixkv:kv_offload_hit_tokens_total{model_name="%s",tier="%s"} %d.0'
    assert hits % (engine.model_name, "host", stats.kv_tier_hit_tokens) in text
    assert hits % (engine.model_name, "pool", stats.kv_pool_hit_tokens) in text
    entries = stats.kv_tier_saved_chunks
    assert f'prefixkv:kv_offload_entries{{model_name="{engine.model_name}",tier="host"}} {entries}.0' in text


def test_a_restarted_engine_finds_its_prefixes_on_disk_and_never_serves_a_damaged_entry(new_llm, expected, tmp_path):
    disk = dict(kv_offload_dir=str(tmp_path), kv_offload_size=16 << 20, kv_offload_chunk_tokens=32)
    first = new_llm(prefix_cache="hash", **POOL, **disk, kv_offload_write_policy="write_back")
    a, _ = prompts(first.get_tokenizer())
    assert run(first, a) == (expected[0], 0)
    assert first.llm_engine.get_stats().kv_tier_entries == 0  # write_back: nothing evicted, nothing written yet
    first.close()  # saves what only the pool holds, flushes the writer, releases the directory

    # chunk keys do not depend on the pool's cache kind
    restarted = new_llm(prefix_cache="radix", **POOL, **disk, debug_nan_kv=True)
    assert run(restarted, a) == (expected[0], 96)
    assert restarted.llm_engine.get_stats().kv_tier_hit_tokens == 96
    restarted.close()

    entry = tmp_path / hash_prompt_blocks(a, 32)[1].hex()[:2] / hash_prompt_blocks(a, 32)[1].hex()
    data = bytearray(entry.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern inside chunk 1's payload
    entry.write_bytes(bytes(data))
    damaged = new_llm(prefix_cache="hash", **POOL, **disk, debug_nan_kv=True)
    assert run(damaged, a) == (expected[0], 32)  # chunk 0 only; chunk 1 recomputed (and stored again)
    assert damaged.llm_engine.get_stats().kv_tier_corrupt == 1
    damaged.close()

    other_chunks = {**disk, "kv_offload_chunk_tokens": 64}  # the directory's manifest says 32
    with pytest.raises(ValueError, match="chunk_tokens"):
        new_llm(prefix_cache="hash", **POOL, **other_chunks)
    ignored = new_llm(prefix_cache="hash", **POOL, **other_chunks, kv_offload_on_mismatch="ignore")
    assert ignored.llm_engine.get_stats().kv_tier_entries == 0  # the directory's entries are never read
    ignored.close()


def test_a_write_back_tier_takes_an_agent_turn_when_its_pause_starts(new_llm, expected):
    """With a write-back tier, a turn with a session hint is written to the tier when it ends (the pause is when to
    write it), not when the pool evicts it; the next turn still gets the same tokens from the tier."""
    from prefixkv.session_hint import SessionHint

    llm = new_llm(prefix_cache="hash", **POOL, **TIER, kv_offload_write_policy="write_back")
    engine = llm.llm_engine
    a, b = prompts(llm.get_tokenizer())
    engine.add_request(
        "turn-1", {"prompt_token_ids": a}, RequestOptions(GREEDY, session=SessionHint("agent-1", None, 30.0))
    )
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    assert engine.sessions.demoted_chunks == 3  # a's full chunks, before anything evicted them
    assert engine.get_stats().kv_tier_saved_chunks == 3
    assert run(llm, b)[1] == 0  # evicts a from the pool: nothing of a is left to save
    engine.flush()
    assert run(llm, a) == (expected[0], 96)
    assert engine.get_stats().kv_tier_saved_chunks == 6  # and b's, when a came back and evicted them


def test_a_session_turn_is_read_back_from_disk_before_its_pause_ends(new_llm, reference, expected, tmp_path):
    """session_policy session+prefetch, on the engine's injected clock: a turn announcing a 30 s pause is read back
    from the disk tier 1 s before the pause ends, so the next turn's admission loads every chunk the pool lost from
    what was read ahead, reading nothing itself, and gets the recompute's tokens. A late session's read-ahead is
    dropped at the pause x 1.25 + 1 s."""
    from prefixkv.session_hint import SessionHint

    now = [1000.0]
    disk = dict(kv_offload_dir=str(tmp_path), kv_offload_size=16 << 20, kv_offload_chunk_tokens=32)
    llm = new_llm(prefix_cache="hash", **POOL, **disk, session_policy="session+prefetch", clock=lambda: now[0])
    engine = llm.llm_engine
    a, b = prompts(llm.get_tokenizer())

    def turn(request_id: str, prompt: list[int]):
        engine.add_request(
            request_id, {"prompt_token_ids": prompt}, RequestOptions(GREEDY, session=SessionHint("agent", None, 30.0))
        )
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        return outputs[-1]

    assert turn("turn-1", a).outputs[0].token_ids == expected[0]
    assert run(llm, b) == (expected[1], 0)  # evicts the turn's pages but its first (write_through: all on disk)
    engine.flush()
    assert engine.run_timers() == 29.0 and engine.get_stats().kv_tier_read_ahead_chunks == 0
    now[0] += 29.0
    engine.run_timers()
    engine.flush()  # the reads ahead are done
    reads = engine.kv.tier.stats.hits
    assert engine.get_stats().kv_tier_read_ahead_chunks == 3

    prompt = [*a, *expected[0], *b[:10]]  # the next turn resends the conversation
    second = turn("turn-2", prompt)
    assert second.outputs[0].token_ids == run(reference, prompt)[0] and second.num_cached_tokens == 96
    assert engine.get_stats().kv_tier_read_ahead_loaded_chunks == 3 and engine.kv.tier.stats.hits == reads

    assert run(llm, b)[0] == expected[1]  # evicts turn 2
    now[0] += 29.0
    engine.run_timers()
    assert engine.kv._staged_bytes == 3 * engine.kv.tier.manifest.payload_bytes
    now[0] += 10.0  # 39 s after the answer: the session is late
    assert engine.run_timers() is None and engine.kv._staged_bytes == 0
    assert engine.sessions.read_aheads_expired == 1
    engine.kv.check_invariants()
    llm.close()
