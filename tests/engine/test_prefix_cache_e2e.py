"""Prefix caching end to end on the real model: same tokens as caching off, and the hits it promises."""

from __future__ import annotations

import random

import pytest

from prefixkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)

SYSTEM = (
    "You are a meticulous support agent for Northwind Bikes. Always answer in two sentences, mention the "
    "warranty when relevant, and never invent part numbers. "
)


def hit_heavy_workload(tok) -> list[list[int]]:
    """Shared system prompts, a multi-turn conversation, repeats, last-token variants, sub-block prompts."""
    rng = random.Random(1)
    system = tok.encode(SYSTEM * 4)
    prompts = []
    for q in ("How do I fix a flat?", "Is the frame covered?", "What tyre pressure?"):
        prompts.append(system + tok.encode(q))
    history = tok.encode(SYSTEM)
    for turn in range(4):  # each turn is the whole conversation so far + a new message
        history = history + tok.encode(f" User: question number {turn}? Assistant: answer {turn}.")
        prompts.append(list(history))
    repeated = [rng.randrange(200, 40000) for _ in range(70)]
    prompts += [repeated, list(repeated)]
    prompts += [repeated[:-1] + [11], repeated[:-1] + [12]]  # differ only in the last token
    prompts += [repeated[:5], repeated[:15], [42]]  # shorter than one block
    return prompts


@pytest.fixture(scope="module")
def workload_and_expected(llm_factory):
    llm = llm_factory(prefix_cache="off")
    prompts = hit_heavy_workload(llm.get_tokenizer())
    expected = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    ]
    return prompts, expected


@pytest.mark.parametrize(
    "options, one_by_one",
    [
        (dict(prefix_cache="hash"), True),
        (dict(prefix_cache="hash", prefix_caching_hash_algo="xxhash", max_num_batched_tokens=40), False),
        (dict(prefix_cache="radix", page_size=1), True),
        (dict(prefix_cache="radix", page_size=16, max_num_batched_tokens=40, schedule_policy="bounded-lpm"), False),
    ],
    ids=["hash", "hash-xxhash-chunked", "radix-page1", "radix-page16-chunked-bounded"],
)
def test_caching_on_equals_off_sequential_and_batched(llm_factory, workload_and_expected, options, one_by_one):
    """One prompt at a time (each hits what the ones before it cached) and all at once (hits within the batch);
    the chunked variants run the batch only: their one-at-a-time hits are the unchunked variants'."""
    prompts, expected = workload_and_expected
    llm = llm_factory(**options, debug_nan_kv=True)
    llm.reset_prefix_cache()
    if one_by_one:
        alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in alone] == expected
        assert sum(o.num_cached_tokens for o in alone) > 0.4 * sum(len(p) for p in prompts)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == expected
    assert one_by_one or sum(o.num_cached_tokens for o in batched) > 0
    assert llm.llm_engine.get_stats().num_pages_used == 0


SYSTEM_TOKENS = 256  # 16 pages, a multiple of the page size: the whole system prompt is a hit


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_system_prompt_hit_counts_and_isolation(llm_factory, cache):
    llm = llm_factory(prefix_cache=cache, debug_nan_kv=True)
    llm.reset_prefix_cache()
    tok = llm.get_tokenizer()
    rng = random.Random(2)
    system = [rng.randrange(200, 40000) for _ in range(SYSTEM_TOKENS)]
    q1 = [rng.randrange(200, 40000) for _ in range(50)]
    q2 = [rng.randrange(200, 40000) for _ in range(50)]
    one = SamplingParams(temperature=0, max_tokens=1)
    stats0 = llm.llm_engine.get_stats()
    first = llm.generate({"prompt_token_ids": system + q1}, one, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": system + q2}, one, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == SYSTEM_TOKENS  # whole pages of 16; radix (page 1) matches to the first new one
    salted = llm.generate({"prompt_token_ids": system + q2, "cache_salt": "tenant-b"}, one, use_tqdm=False)[0]
    adapter = llm.generate({"prompt_token_ids": system + q2, "lora_id": "adapter-7"}, one, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0 and adapter.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == second.outputs[0].token_ids
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits - stats0.prefix_cache_hits == SYSTEM_TOKENS
    assert stats.prefix_cache_queries - stats0.prefix_cache_queries == 4 * (SYSTEM_TOKENS + 50)
    assert 0 < stats.prefix_cache_hit_rate < 1
    del tok


def test_reset_prefix_cache_and_chat_hits(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    msgs = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "Hi!"}]
    llm.chat(msgs, GREEDY, use_tqdm=False)
    again = llm.chat(msgs[:1] + [{"role": "user", "content": "Hello?"}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 * 5
    assert llm.reset_prefix_cache() is True
    cold = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0


def test_radix_cache_summary_and_tree(llm_factory):
    llm = llm_factory(prefix_cache="radix")
    assert llm.reset_prefix_cache() is True  # only this test's prompts in the tree
    msgs = [{"role": "system", "content": SYSTEM * 3}]
    for q in ("Hi!", "Hello?", "Hey there"):
        llm.chat(msgs + [{"role": "user", "content": q}], GREEDY, use_tqdm=False)
    summary = llm.cache_summary()
    assert summary.type == "radix" and summary.cached_tokens > 0
    assert summary.top_prefixes and summary.top_prefixes[0].hits >= 2
    tree = llm.render_cache_tree()
    assert "meticulous support agent" in tree and "hits=2" in tree
