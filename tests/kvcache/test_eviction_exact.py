"""Eviction policies on the real model: whatever a policy evicts, fp32 greedy output equals caching off."""

from __future__ import annotations

import random

import pytest

from prefixkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3)


def prompts() -> list[list[int]]:
    """A system prompt asked two questions, each after a one-off prompt: on a pool of six 16-token
    pages every policy has to evict, and has hits to lose."""
    rng = random.Random(3)
    system = [rng.randrange(200, 30000) for _ in range(35)]
    out = []
    for _question in range(2):
        out.append(system + [rng.randrange(200, 30000) for _ in range(6)])
        out.append([rng.randrange(200, 30000) for _ in range(40)])
    return out


@pytest.fixture(scope="module")
def expected(new_llm):
    llm = new_llm(prefix_cache="off", kv_cache_tokens=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# each policy once, each cache's new code path once: the radix heap serves every policy, the hash cache's heap of
# chain tails every policy but LRU (which keeps the free queue); tests/kvcache/test_radix_vs_hash.py shows both
# caches evict alike under every policy
@pytest.mark.parametrize("eviction, cache", [("lru", "radix"), ("lfu", "hash"), ("cost", "radix")])
def test_greedy_output_with_each_policy_equals_caching_off(new_llm, expected, cache, eviction):
    llm = new_llm(prefix_cache=cache, page_size=16, kv_cache_tokens=96, max_num_seqs=2, eviction=eviction)
    got = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts()]
    assert [o.outputs[0].token_ids for o in got] == expected
    assert sum(o.num_cached_tokens for o in got) >= 32
    kv = llm.llm_engine.kv
    assert kv.stats.hits > 0 and kv.stats.evicted_pages > 0
    kv.check_invariants()
    assert llm.llm_engine.get_stats().num_pages_used == 0
