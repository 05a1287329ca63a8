"""The offline rows, timed the same way for both engines: wall clock around one blocking generate() call.

Each side wraps its engine in a `generate(prompts, max_tokens) -> [(output_tokens, cached_tokens), ...]` function
(greedy, ignore_eos) and hands it here, so the two engines differ only in that wrapper. TTFT is the wall time of a
max_tokens=1 request, as a user of either LLM class would measure it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from compare_vllm.workloads import OfflinePrompts, Sizes

Generate = Callable[[list[list[int]], int], list[tuple[int, int]]]


def _timed(generate: Generate, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[tuple[int, int]]]:
    start = time.perf_counter()
    outs = generate(prompts, max_tokens)
    return time.perf_counter() - start, outs


def run_offline_rows(generate: Generate, sizes: Sizes, seed: int = 0) -> dict:
    """Warm-up, cold and warm TTFT, shared-prefix and zero-hit throughput, in that order, in one engine.

    The engine must be new (nothing cached): cold TTFT is the first time it sees the system prompt. The warm-up
    runs a short prompt and one unrelated prompt as long as the TTFT prompt, so one-time costs (allocator growth,
    compiled shapes) stay out of the timed rows.
    """
    prompts = OfflinePrompts.build(sizes, seed)
    generate([prompts.warmup_short], 1)
    generate([prompts.warmup_long], 1)

    cold_s, cold_out = _timed(generate, [prompts.system + prompts.questions[0]], 1)
    warm = [_timed(generate, [prompts.system + q], 1) for q in prompts.questions[1:]]
    warm_s = [t for t, _ in warm]

    shared_s, shared_out = _timed(generate, prompts.shared, sizes.output_tokens)
    zero_s, zero_out = _timed(generate, prompts.zero_hit, sizes.output_tokens)

    def out_tokens(outs):
        return sum(o for o, _ in outs)

    def cached_tokens(outs):
        return sum(c for _, c in outs)

    return {
        "cold_ttft_s": cold_s,
        "warm_ttft_s": statistics.median(warm_s),
        "shared_prefix_tok_s": out_tokens(shared_out) / shared_s,
        "zero_hit_tok_s": out_tokens(zero_out) / zero_s,
        "detail": {  # what the rows did, to check them by: cached tokens show whether caching acted as expected
            "warm_ttft_samples_s": warm_s,
            "cold_cached_tokens": cached_tokens(cold_out),
            "warm_cached_tokens": [cached_tokens(o) for _, o in warm],
            "shared_prefix_s": shared_s,
            "shared_prefix_output_tokens": out_tokens(shared_out),
            "shared_prefix_cached_tokens": cached_tokens(shared_out),
            "zero_hit_s": zero_s,
            "zero_hit_output_tokens": out_tokens(zero_out),
            "zero_hit_cached_tokens": cached_tokens(zero_out),
        },
    }
