"""Greedy fp32 outputs must not depend on batching, chunking, preemption or the prefix cache.

The tests are in the order of the engines they ask llm_factory for, which keeps only the last two: the tests on
the reference's engine (caching off) come right after it, so it is built once; a rebuilt whole-context pool costs
seconds where freed memory goes back to the host (this test VM's balloon) and has to be faulted in again.
"""

from __future__ import annotations

import random

import pytest

from prefixkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompts(tok) -> list[list[int]]:
    """16 prompts of mixed lengths (5..170 tokens), some sharing prefixes."""
    rng = random.Random(0)
    base = (
        tok.encode(
            "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type, oil-based ink and a screw press. "
        )
        * 3
    )
    out = []
    for i in range(16):
        if i % 3 == 0:
            out.append(base[: 20 + 17 * i] + [rng.randrange(100, 40000) for _ in range(i + 1)])
        else:
            out.append([rng.randrange(100, 40000) for _ in range(5 + 11 * i)])
    return out


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llm_factory):
    """Each prompt alone, caching off, a roomy pool."""
    llm = llm_factory(prefix_cache="off")
    prompts = _prompts(llm.get_tokenizer())
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return prompts, alone


def test_batch_of_16_mixed_lengths_matches_alone(llm_factory, reference):
    prompts, alone = reference
    llm = llm_factory(prefix_cache="off")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert _tokens(outs) == alone


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch_and_n_fans_out(llm_factory, reference):
    prompts, _ = reference
    llm = llm_factory(prefix_cache="off")
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], seeded, use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    two = llm.generate(
        {"prompt_token_ids": prompts[1]},
        SamplingParams(temperature=0.9, seed=1234, n=2, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in two.outputs] == [0, 1]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in two.outputs)


def test_tiny_token_budget_forces_chunked_prefill(llm_factory, reference):
    prompts, alone = reference
    llm = llm_factory(prefix_cache="off", max_num_batched_tokens=64)  # prompts of up to 170 tokens: 1-3 chunks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert _tokens(outs) == alone


def test_every_page_is_free_after_all_requests_finish_or_abort(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    engine = llm.llm_engine
    ids = [engine.add_request(None, {"prompt_token_ids": list(range(200 + i, 260 + i))}, GREEDY) for i in range(6)]
    engine.step()
    engine.step()
    engine.abort(ids[0])
    engine.abort(ids[3])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_pages_used == 0
    assert engine.get_stats().num_running == 0 and engine.get_stats().num_waiting == 0
    engine.kv.check_invariants()


@pytest.mark.parametrize("cache", ["off", "hash"])
def test_small_pool_forces_preemption(llm_factory, reference, cache):
    prompts, alone = reference
    llm = llm_factory(prefix_cache=cache, kv_cache_tokens=640, max_num_batched_tokens=256, debug_nan_kv=True)
    before = llm.llm_engine.get_stats().num_preemptions
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > before, "the pool was meant to be too small"
    assert _tokens(outs) == alone
    assert llm.llm_engine.get_stats().num_pages_used == 0
