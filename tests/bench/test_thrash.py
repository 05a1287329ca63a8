import argparse

import pytest

from prefixkv.bench import page_size, schedule_cost, thrash
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.sim.simulator import make_policy, simulate, summarize_run


def parse(module, argv):
    p = argparse.ArgumentParser()
    module.register(p.add_subparsers())
    return p.parse_args(argv)


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_thrash_targets_hold_in_a_small_simulation(cache):
    args = parse(
        thrash,
        ["thrash", "--requests-per-group", "40", "--arrival-every", "3", "--max-wait-steps", "24", "--cache", cache],
    )
    r = args.func(args)
    p = r["policies"]
    assert r["mode"].startswith("simulated")
    assert p["lpm"]["of_optimal"] >= 0.96
    assert p["dfs-weight"]["of_optimal"] >= 0.96
    assert p["fcfs"]["token_hit_rate"] < 0.6 * p["lpm"]["token_hit_rate"]  # fcfs thrashes
    assert p["bounded-lpm"]["of_optimal"] >= 0.9
    assert p["bounded-lpm"]["p99_wait_steps"] < p["lpm"]["p99_wait_steps"] / 2
    assert p["bounded-lpm"]["max_wait_steps"] <= 24 + 60  # the bound, then the running hot requests drain


def test_thrash_takes_the_engine_options_with_its_own_defaults():
    args = parse(thrash, ["thrash"])
    assert (args.prefix_cache, args.page_size, args.max_num_seqs, args.max_wait_steps) == ("radix", 16, 8, 128)
    assert (args.dtype, args.seed, args.max_num_batched_tokens) == ("bfloat16", 0, 2048)
    args = parse(thrash, ["thrash", "--cache", "hash", "--kernel-options", "native_attention=0"])
    assert args.prefix_cache == "hash" and args.kernel_options == "native_attention=0"


def test_thrash_on_model_runs_every_policy_on_engines_from_the_factory(llm_factory):
    args = parse(
        thrash,
        "thrash --requests-per-group 3 --prefix-len 48 --suffix-len 4 --output-len 2 --policies fcfs,lpm "
        "--on-model".split(),
    )
    asked = []

    def factory(**options):
        asked.append(options)
        return llm_factory(**options)

    r = thrash.run(args, llm_factory=factory)
    assert [o["schedule_policy"] for o in asked] == ["fcfs", "lpm"]
    assert all(o["prefix_cache"] == "radix" and o["page_size"] == 16 for o in asked)
    for s in r["on_model"].values():
        assert s["requests"] == 6 and s["token_hit_rate"] > 0


def test_page_size_and_schedule_cost_run():
    r = page_size.run(
        parse(page_size, ["page-size", "--num-conversations", "4", "--turns", "3", "--system-len", "200"])
    )
    hits = [r["page_sizes"][s]["hit_tokens"] for s in ("1", "16", "64")]
    assert hits[0] >= hits[1] >= hits[2] > 0
    r = schedule_cost.run(
        parse(
            schedule_cost,
            ["schedule-cost", "--sizes", "64", "--prefix-len", "64", "--num-prefixes", "4", "--repeats", "1"],
        )
    )
    assert len(r["cases"]) == 2 * len(schedule_cost.POLICIES) and all(c["step_ms"] >= 0 for c in r["cases"])


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_hit_gauge_counts_first_admissions_only_under_preemption(cache):
    """Long outputs in the thrash pool force preemptions. A preempted request finds its own pages again when it
    comes back; counting that hit too would put the gauge above the offline optimum. The gauge (and the cache
    summary) count first admissions; re-admissions are counted apart."""
    work = thrash.thrash_workload(requests_per_group=20, prefix_len=256, suffix_len=32, output_len=64)
    kv = create_kv_cache_manager(cache, thrash.pool_pages(256, 32, 16, 8, 16), 16)
    res = simulate(kv, make_policy("lpm"), work, max_num_seqs=8)
    kv.check_invariants()
    s = summarize_run(res, kv)
    optimal = thrash.optimal_hit_tokens(work, 256, 16) / s["prompt_tokens"]
    stats = kv.stats
    assert res.preemptions > 0 and stats.readmissions > 0 and stats.readmission_hits > 0
    assert stats.requests == len(work) and stats.queries == s["prompt_tokens"]
    assert stats.hits == s["hit_tokens"] == sum(r.num_cached_tokens for r in res.requests)
    assert stats.hit_rate == s["cache_hit_rate"] == s["token_hit_rate"] <= optimal
    every_admission = (stats.hits + stats.readmission_hits) / (stats.queries + stats.readmission_queries)
    assert every_admission > optimal  # what the gauge reported when re-admissions counted
    summary = kv.summary()
    assert summary.hits == stats.hits and summary.readmission_hits == stats.readmission_hits
