"""bf16 greedy answers do not change on a cache hit, nor in a batch (KernelOptions.cache_invariant).

The prompts are made like `prefixkv bench cache-invariance`'s: short questions, questions behind four shared
system prompts and the turns of multi-turn chats, 120 in all (the bench's 200, with 16 tokens each, are the
evidence kept per CPU family in docs/benchmarks/cache_invariance/; 120 keep this module near a minute where bf16
runs on AVX2, AMD EPYC Zen 3). Every prompt is answered cold once (caching off, the whole
set in one batch), then warm by one of four engines (hash cache with 16-token pages, radix cache with 1-token
pages, each also with prefill chunked by a 64-token budget), each taking a quarter of the set: after its shared
parts were prewarmed (partial hits) and once more (full hits: only the last token or page is computed). Warm
tokens must equal cold ones exactly, and the warm runs must really have hit: a prewarmed prompt at least one
token, every prompt of the full-hit run all of itself but its last page. In bf16 nothing here may be a
near-tie excuse: the arithmetic of every token is the same cold or warm, so any difference is a bug.
"""

from __future__ import annotations

import pytest

from prefixkv.bench.cache_invariance import answer, flips, invariance_prompts, spread_by_length, warm_runs
from prefixkv.llm import kernel_line
from prefixkv.model import cpu_features, native
from tests import kernels

pytestmark = kernels.NATIVE_ATTENTION

MAX_TOKENS = 4
CONFIGS = {  # name: (cache, page size, prefill token budget)
    "hash-page16": ("hash", 16, 2048),
    "radix-page1": ("radix", 1, 2048),
    "hash-page16-chunked": ("hash", 16, 64),
    "radix-page1-chunked": ("radix", 1, 64),
}


@pytest.fixture(scope="module")
def cold(new_llm):
    """(caching-off engine, prompts, cold outputs): the whole set answered in one batch with caching off."""
    llm = new_llm(dtype="bfloat16", prefix_cache="off")
    assert llm.llm_engine.runner.options.cache_invariant
    # what the start log line, /metrics and bench JSON report: this CPU, our kernels, invariance on
    kernels = llm.llm_engine.kernels
    # avx512_bf16, or avx2 without AVX-512; each AMX family where its own self-test passed
    want_matmul = "amx" if native.amx_gemm() is not None else native.gemm_isa()
    want_attention = "amx" if native.amx_attention() is not None else native.attention_isa()
    want_path = "amx" if "amx" in (want_matmul, want_attention) else want_matmul
    assert (kernels["isa_path"], kernels["matmul"], kernels["cache_invariant"]) == (want_path, want_matmul, "on")
    assert kernels["attention"] == want_attention
    line = kernel_line(kernels, "bfloat16")
    assert cpu_features.model_name() in line and f"kernels {want_path}" in line and "cache invariance on" in line
    prompts = invariance_prompts(llm.get_tokenizer(), num_short=32, num_system=48, num_turns=40, turns_per_chat=4)
    return llm, prompts, answer(llm, prompts, MAX_TOKENS, sequential=False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_warm_answers_equal_cold_ones(cold, new_llm, name):
    _, prompts, cold_outputs = cold
    cache, page_size, budget = CONFIGS[name]
    index = list(CONFIGS).index(name)
    mine = list(range(index, len(prompts), len(CONFIGS)))
    llm = new_llm(
        dtype="bfloat16", prefix_cache=cache, page_size=page_size, max_num_batched_tokens=budget, debug_nan_kv=True
    )
    warm = warm_runs(llm, [prompts[i] for i in mine], MAX_TOKENS, sequential=False)
    want = [cold_outputs[i] for i in mine]
    for phase, outputs in warm.items():
        # partial hits: every prompt with a prewarmed shared part hits; full hits: every prompt hits all of itself
        # but the last page (the last token must be computed, and a hit ends on a whole page)
        least = {
            k: len(prompts[mine[k]].token_ids) - page_size if phase == "full_hit" else 1
            for k in range(len(outputs))
            if phase == "full_hit" or prompts[mine[k]].shared_ids
        }
        missed = [
            (mine[k], outputs[k].num_cached_tokens, n) for k, n in least.items() if outputs[k].num_cached_tokens < n
        ]
        assert not missed, f"{phase}: (prompt, cached, expected at least) {missed}: they would pass vacuously"
        flipped = [mine[k] for k in flips(want, outputs)]
        assert not flipped, f"{phase}: prompts {flipped} answered differently warm than cold"


def test_a_prompt_answers_the_same_alone_and_in_a_batch_of_16(cold):
    """Batch invariance: 16 prompts of mixed lengths, each alone == in the cold batch."""
    llm, prompts, cold_outputs = cold
    picked = spread_by_length(prompts, 16)
    alone = answer(llm, [prompts[i] for i in picked], MAX_TOKENS, sequential=True)
    batch = answer(llm, [prompts[i] for i in picked], MAX_TOKENS, sequential=False)
    want = [cold_outputs[i] for i in picked]
    assert not flips(want, alone), "a prompt answered alone differs from the same prompt in the whole-set batch"
    assert not flips(want, batch), "a prompt in a batch of 16 differs from the same prompt in the whole-set batch"
