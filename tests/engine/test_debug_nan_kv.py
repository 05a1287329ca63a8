"""debug_nan_kv: a read of freed KV fails loudly instead of giving a plausible answer.

The bug planted here is the one the mode exists for: a cache that still finds blocks whose KV it dropped. Without
the mode the stale pages still hold the old KV and the answer looks right; with it they hold NaN and the step
raises. The cache correctness tests run with the mode on (caching on == off and the hits it promises, bf16 warm ==
cold, same-step duplicate reads, a pool small enough to preempt, KV back from the tier), so none of them can pass
on KV that was never written or was freed, and each shows the mode changes no answer.
"""

from __future__ import annotations

import pytest

from prefixkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPT = "You are a careful assistant for a bike shop. " * 6 + "How do I fix a flat tyre?"


def _stale_hit(llm) -> list[int]:
    """Answer PROMPT, drop every cached block, then make the hash cache find them again (the planted bug), and
    answer PROMPT once more from those blocks."""
    first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    kv = llm.llm_engine.kv
    cached = dict(kv.cached)
    assert len(cached) >= 4
    kv.reset_prefix_cache()
    for key, block in cached.items():  # the bug: keys kept for blocks whose KV went with the reset
        block.block_hash = key
        kv.cached[key] = block
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 4 * kv.page_size
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    return again.outputs[0].token_ids


def test_a_stale_hit_looks_right_without_the_mode(new_llm):
    _stale_hit(new_llm(prefix_cache="hash", kv_cache_tokens=1024))


def test_a_stale_hit_raises_with_the_mode(new_llm):
    llm = new_llm(prefix_cache="hash", kv_cache_tokens=1024, debug_nan_kv=True)
    with pytest.raises(RuntimeError, match="debug_nan_kv: the logits of .* are not finite"):
        _stale_hit(llm)


def test_poisoning_refuses_pages_outside_the_pool(new_llm):
    runner = new_llm(debug_nan_kv=True, kv_cache_tokens=64).llm_engine.runner
    with pytest.raises(ValueError, match="outside the pool"):
        runner.poison_pages([runner.num_pages])  # the pad page, which must stay finite


def test_the_flag_parses_both_ways():
    import argparse

    from prefixkv.config import EngineConfig
    from prefixkv.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(["--debug-nan-kv"]))).debug_nan_kv is True
    assert EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args(["--no-debug-nan-kv"]))).debug_nan_kv is False
    assert EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args([]))).debug_nan_kv is False
    with pytest.raises(ValueError, match="debug_nan_kv must be True or False"):
        EngineConfig(debug_nan_kv="yes")  # type: ignore[arg-type]
