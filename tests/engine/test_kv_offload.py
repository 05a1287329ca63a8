"""The KV offload tier on the real model (fp32, greedy): what comes back from the tier gives the same tokens as a
recompute, across an eviction from the pool and across a restart of the engine.

Pages of 16 tokens, chunks of 32, a pool too small to hold two of the prompts: the second evicts the first.
"""

from __future__ import annotations

import pytest

from prefixkv.engine.engine import Engine
from prefixkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
POOL = dict(kv_cache_tokens=160, page_size=16, max_num_batched_tokens=512)  # 10 pages; a prompt takes 9
TIER = dict(kv_offload_host_size=64 << 20, kv_offload_chunk_tokens=32)


def prompts(tok) -> tuple[list[int], list[int]]:
    a = tok.encode("You are a careful assistant for a bicycle shop. Answer briefly and politely. " * 9)[:136]
    b = tok.encode("The history of the printing press begins in Mainz, around the year 1450. " * 9)[:136]
    return a, b


def run(llm, prompt: list[int]) -> tuple[list[int], int]:
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.fixture(scope="module")
def expected(new_llm):
    llm = new_llm(prefix_cache="off", **POOL)
    a, b = prompts(llm.get_tokenizer())
    return run(llm, a)[0], run(llm, b)[0]


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_outputs_are_identical_across_an_eviction_and_a_restart(new_llm, expected, kind):
    llm = new_llm(prefix_cache=kind, **POOL, **TIER)
    engine = llm.llm_engine
    a, b = prompts(llm.get_tokenizer())
    assert run(llm, a) == (expected[0], 0)
    assert run(llm, b) == (expected[1], 0)  # evicts a from the pool
    engine._tier_writer.flush()
    tokens, cached = run(llm, a)
    assert tokens == expected[0] and cached == 128  # every full chunk below a's last token
    stats = engine.get_stats()
    assert stats.kv_tier == "host" and stats.kv_tier_hit_tokens > 0 and stats.kv_tier_loaded_bytes > 0
    assert stats.kv_tier_saved_chunks == 8 and 0 < stats.kv_pool_hit_tokens < 128  # the pool kept a's start
    engine.kv.check_invariants()

    # a restart: a new engine (empty pool manager) on the same tier
    engine.close()
    again = Engine(engine.config, engine.runner, engine.tokenizer, engine.model_config, kv_tier=engine.kv_tier)
    llm.llm_engine = again
    for prompt, want in zip((b, a), expected[::-1]):
        tokens, cached = run(llm, prompt)
        assert tokens == want and cached == 128
    assert again.get_stats().kv_tier_hit_tokens == 2 * 128
    again.kv.check_invariants()
    again.close()
