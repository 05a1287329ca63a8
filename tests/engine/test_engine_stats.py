"""EngineStats on the real engine: the prefix-cache counters count first admissions; preempted requests that
come back are counted apart."""

from __future__ import annotations

import random

from prefixkv.sampling_params import SamplingParams
from prefixkv.server.metrics import ServerMetrics


def test_readmissions_are_counted_apart(llm_factory):
    llm = llm_factory(prefix_cache="hash", kv_cache_tokens=640, max_num_batched_tokens=256)
    engine = llm.llm_engine
    rng = random.Random(1)
    shared = [rng.randrange(100, 40000) for _ in range(64)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(40 + 9 * i)] for i in range(12)]
    before = engine.get_stats()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    after = engine.get_stats()
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to be too small"
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(map(len, prompts))
    assert after.prefix_cache_hits - before.prefix_cache_hits == sum(o.num_cached_tokens for o in outs)
    assert after.prefix_cache_readmission_queries > before.prefix_cache_readmission_queries
    summary = engine.cache_summary()
    assert summary.queries == after.prefix_cache_queries
    assert summary.readmission_queries == after.prefix_cache_readmission_queries
    assert engine.kv.num_used_pages() == 0
    # and so on the server's /metrics (the page is rendered from these stats)
    page = ServerMetrics("m").render(after).decode()
    assert (
        f'prefixkv:prefix_cache_readmission_queries_total{{model_name="m"}} '
        f"{float(after.prefix_cache_readmission_queries)}" in page
    )
    assert f'prefixkv:prefix_cache_hits_total{{model_name="m"}} {float(after.prefix_cache_hits)}' in page
