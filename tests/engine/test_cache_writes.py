"""The cache writes each request reports (RequestOutput.cache_writes) on the real engine: what the cache's own
inserts made cacheable, never whole pages minus the hit.

The ground truth is the cache's own bookkeeping: over one request run alone, the pages it inserted are the pages
the cache gained plus the pages it evicted meanwhile (Δ cached + Δ evicted). With max_tokens=1 the sampled token
is never computed, so everything inserted is the prompt's. Pages of 16 tokens; prompts are token ids.
"""

from __future__ import annotations

import pytest

from prefixkv.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1)
PAGE = 16
POOL = dict(kv_cache_tokens=1024, page_size=PAGE, max_num_batched_tokens=1024)


def prompt(tag: int, n: int = 96) -> list[int]:
    """n token ids of their own (no other tag's page matches any of them)."""
    return [1000 + 50 * tag + (i * 7) % 50 for i in range(n)]


def inserted_pages(engine) -> int:
    kv = engine.kv
    return kv.num_cached_pages() + kv.stats.evicted_pages


def generate(llm, prompts, **kw):
    outs = llm.generate([{"prompt_token_ids": p, **kw} for p in prompts], ONE, use_tqdm=False)
    llm.llm_engine.kv.check_invariants()
    return outs


def adds_up(out) -> None:
    """read + written never exceed the prompt; writes are whole pages inside it, past the hit."""
    writes = out.cache_writes
    assert out.num_cached_tokens + out.num_written_tokens <= len(out.prompt_token_ids)
    assert all(s % PAGE == 0 and e % PAGE == 0 and s >= out.num_cached_tokens for s, e in writes.pool)
    assert all(e <= len(out.prompt_token_ids) for s, e in writes.pool)


@pytest.fixture(scope="module", params=["hash", "radix"])
def llm(request, new_llm):
    return new_llm(prefix_cache=request.param, **POOL)


def test_duplicates_in_one_step_write_once(llm):
    """Two identical prompts submitted together (one step: the hash cache's second request hits the first's pages
    keyed in flight, the radix cache defers it a step): the first writes every whole page, the second none, not
    even its last page, which it computes again (its last token is always computed) though the first cached it.
    A prompt of whole pages: the formula (whole pages minus the hit) would claim that page."""
    p = prompt(1, 6 * PAGE)
    before = inserted_pages(llm.llm_engine)
    first, second = generate(llm, [p, p])
    assert first.num_cached_tokens == 0 and first.num_written_tokens == 6 * PAGE
    assert first.cache_writes.pool == ((0, 6 * PAGE),)
    assert second.num_cached_tokens == 5 * PAGE and second.num_written_tokens == 0
    assert (inserted_pages(llm.llm_engine) - before) * PAGE == first.num_written_tokens
    again = generate(llm, [p])[0]  # wholly cached already: reads 5 pages, writes nothing
    assert (again.num_cached_tokens, again.num_written_tokens) == (5 * PAGE, 0)
    for out in (first, second, again):
        adds_up(out)


def test_each_salt_writes_its_own_pages(llm):
    """The same prompt under two cache salts, in one step, then unsalted: three namespaces, each request writes all
    its whole pages and reads none; the same salt again reads them and writes nothing."""
    p = prompt(2, 100)
    engine = llm.llm_engine
    before = inserted_pages(engine)
    outs = llm.generate([{"prompt_token_ids": p, "cache_salt": s} for s in ("s1", "s2")], ONE, use_tqdm=False)
    outs += generate(llm, [p])
    for out in outs:
        assert out.num_cached_tokens == 0 and out.num_written_tokens == 6 * PAGE
    assert (inserted_pages(engine) - before) * PAGE == 3 * 6 * PAGE
    again = generate(llm, [p], cache_salt="s2")[0]
    assert (again.num_cached_tokens, again.num_written_tokens) == (6 * PAGE, 0)


def test_a_pool_too_small_to_keep_pages(new_llm):
    """8 pages, prompts of 6 whole pages and a partial one: each evicts the other's pages. Every request's writes
    are what the cache inserted while it ran, rewrites of evicted pages included; submitted together, one waits
    for pages and their writes still add up to what the cache inserted."""
    for kind in ("hash", "radix"):
        llm = new_llm(prefix_cache=kind, kv_cache_tokens=8 * PAGE, page_size=PAGE, max_num_batched_tokens=256)
        engine = llm.llm_engine
        a, b = prompt(3, 100), prompt(4, 100)
        for p in (a, b, a, b):
            before = inserted_pages(engine)
            out = generate(llm, [p])[0]
            assert out.num_written_tokens == (inserted_pages(engine) - before) * PAGE > 0
            assert out.num_written_tokens == 6 * PAGE - out.num_cached_tokens
            adds_up(out)
        before = inserted_pages(engine)
        outs = generate(llm, [prompt(5, 100), prompt(6, 100)])
        assert sum(o.num_written_tokens for o in outs) == (inserted_pages(engine) - before) * PAGE
        for out in outs:
            adds_up(out)


def test_prefix_caching_off_writes_nothing(new_llm):
    llm = new_llm(prefix_cache="off", **POOL)
    p = prompt(7, 100)
    for out in generate(llm, [p, p]) + generate(llm, [p]):
        assert out.num_cached_tokens == 0 and out.num_written_tokens == 0 and out.cache_writes.tier_tokens == 0


def test_a_disk_tier_counts_the_chunks_each_request_stored(new_llm, tmp_path):
    """write_through, 32-token chunks: a prompt's whole chunks are handed to the tier by the request that computed
    them, once; a request that finds them in the tier (the pool evicted them) reads them, writing neither the
    tier nor those pages of the pool."""
    disk = dict(kv_offload_dir=str(tmp_path), kv_offload_size=16 << 20, kv_offload_chunk_tokens=32)
    llm = new_llm(prefix_cache="hash", kv_cache_tokens=8 * PAGE, page_size=PAGE, max_num_batched_tokens=256, **disk)
    engine = llm.llm_engine
    a, b = prompt(8, 100), prompt(9, 100)
    first = generate(llm, [a])[0]
    assert first.cache_writes.tier == ((0, 96),) and first.num_written_tokens == 96  # 3 chunks, 6 pages
    assert generate(llm, [b])[0].cache_writes.tier_tokens == 96  # evicts a's pages from the pool
    engine.flush()
    again = generate(llm, [a])[0]
    assert again.num_cached_tokens == 96 and engine.get_stats().kv_tier_hit_tokens > 0
    assert again.cache_writes.tier_tokens == 0 and again.num_written_tokens == 0
    salted = generate(llm, [a], cache_salt="t")[0]  # another namespace: its own chunks
    assert salted.cache_writes.tier_tokens == 96 and salted.num_written_tokens == 96
    llm.close()
