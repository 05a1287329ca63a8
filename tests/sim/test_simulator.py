"""The time-driven simulator: an exact clock on a hand-made workload, exact hit counts in both caches,
rejection of requests that can never fit, and no request kept after it finishes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prefixkv.config import EngineConfig
from prefixkv.sim.cost_model import StepCostModel
from prefixkv.sim.simulator import simulate_trace, summarize_trace

# 1 s per step plus 0.1 s per computed token: step times are easy to add up by hand
CLOCK = StepCostModel("hand", "test", step_overhead_s=1.0, per_token_s=0.1, per_attended_pair_s=0.0)


@dataclass
class Req:
    arrival_s: float
    prompt: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def prompt_tokens(self) -> list[int]:
        return list(self.prompt)


def _config(cache: str, **kw) -> EngineConfig:
    return EngineConfig(prefix_cache=cache, page_size=4, kv_cache_tokens=kw.pop("kv_cache_tokens", 256), **kw)


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_the_clock_gives_exact_ttfts_on_three_requests(cache):
    a = list(range(100, 108))
    work = [Req(0.0, a, 2), Req(0.5, list(range(200, 208)), 1), Req(10.0, a[:4] + [300, 301, 302, 303], 1)]
    res, kv = simulate_trace(_config(cache), work, CLOCK, check_every=1)
    m = {x.request_id: x for x in res.metrics}
    # step 1 (t 0 -> 1.8): r0's 8-token prefill. Step 2 (-> 3.7): r0's decode + r1's prefill (r1 waited 1.3 s).
    # Idle until r2 at 10 s; step 3 (-> 11.4): r2 hits r0's first page and computes its other 4 tokens.
    assert m["r0"].ttft_s == pytest.approx(1.8) and m["r0"].latency_s == pytest.approx(3.7)
    assert m["r0"].queue_s == 0 and m["r1"].queue_s == pytest.approx(1.3)
    assert m["r1"].ttft_s == pytest.approx(3.2)
    assert m["r2"].queue_s == 0 and m["r2"].ttft_s == pytest.approx(1.4) and m["r2"].hit_tokens == 4
    assert res.sim_seconds == pytest.approx(11.4) and res.steps == 3
    s = summarize_trace(res, kv)
    assert s["output_tokens"] == 4 and s["hit_tokens"] == 4 and s["prompt_tokens"] == 24
    assert s["ttft_s"]["max"] == pytest.approx(3.2) and s["rejected_requests"] == 0


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_exact_hit_counts_on_a_hand_made_trace(cache):
    base = list(range(1, 13))  # three pages of 4
    work = [
        Req(0, base, 1),  # nothing cached: 0
        Req(10, base[:8] + [50, 51, 52, 53], 1),  # two pages: 8
        Req(20, base[:4] + list(range(60, 68)), 1),  # one page: 4
        Req(30, base + [70], 1),  # all three pages: 12
        Req(40, base, 1),  # the same 12 tokens: a hit leaves the last token to compute, so two pages: 8
    ]
    res, kv = simulate_trace(_config(cache), work, CLOCK, check_every=1)
    assert [m.hit_tokens for m in res.metrics] == [0, 8, 4, 12, 8]
    assert kv.stats.hits == 32 and summarize_trace(res, kv)["token_hit_rate"] == pytest.approx(32 / 61)
    kv.check_invariants()


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_finish():
    work = [Req(0, list(range(10, 40)), 4), Req(0, list(range(100, 160)), 8), Req(1, list(range(200, 210)), 2)]
    res, kv = simulate_trace(_config("hash", kv_cache_tokens=64), work, CLOCK, check_every=1)
    assert [(m.request_id, m.rejected) for m in res.rejected] == [("r1", True)]  # 60 + 8 > 64 tokens
    s = summarize_trace(res, kv)
    assert s["rejected_requests"] == 1 and s["served_requests"] == 2 and s["output_tokens"] == 6
    res, _ = simulate_trace(_config("hash", max_model_len=20), work[2:], CLOCK)  # 10 + 2 <= 20: served
    assert not res.rejected


def test_finished_requests_are_released():
    work = [Req(i * 0.01, [1, 2, 3, 4, 5, i + 10], 3) for i in range(20)]
    res, kv = simulate_trace(_config("radix", max_num_seqs=4), work, CLOCK, check_every=1)
    assert res.requests == [] and len(res.metrics) == 20 and res.output_tokens == 60
    assert kv.num_free_pages() == kv.num_pages  # everything is evictable again: nobody holds a page
