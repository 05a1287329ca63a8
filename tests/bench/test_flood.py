"""`prefixkv bench flood`, tiny: the retained prefix keeps every hit while retained and decays after, the cap
holds, every request finishes; and the on-model replay runs on the real engine."""

from __future__ import annotations

import argparse

import pytest

from prefixkv.bench import flood

TINY = (
    "flood --num-requests 400 --hot-every 20 --prefix-len 256 --flood-len 128 --pool-tokens 2048 --retention-s 10"
    " --arrival-every-s 0.05"
).split()


def parse(argv):
    p = argparse.ArgumentParser()
    flood.register(p.add_subparsers())
    return p.parse_args(argv)


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_retained_prefix_survives_the_flood_in_simulation(cache):
    r = flood.run(parse([*TINY, "--cache", cache]))
    kept, baseline = r["retention"], r["no_retention"]
    assert kept["hot_requests_while_retained"] >= 8 and kept["hot_requests_after_deadline"] >= 8
    assert kept["hot_full_hit_rate_while_retained"] == 1.0
    assert kept["hot_full_hit_rate_after_deadline"] < 0.5  # decayed: the flood evicts it again
    assert baseline["hot_full_hit_rate_while_retained"] < 0.5  # without retention LRU loses it between uses
    assert 0 < kept["max_retained_pages"] <= kept["retained_capacity_pages"]
    assert kept["retention_released_by_cap"] > 0  # the flood's own retentions hit the cap
    assert kept["all_finished"] and baseline["all_finished"]


def test_flood_on_model_runs(llm_factory):
    args = parse(
        "flood --num-requests 6 --hot-every 3 --prefix-len 48 --suffix-len 4 --flood-len 24 --output-len 1 "
        "--retention-s 600".split()
    )
    llm = llm_factory(kv_cache_tokens=4096)  # the small-pool engine other modules use: no build of its own
    r = flood.run_on_model(args, flood.flood_workload(args), llm=llm)
    llm.reset_prefix_cache()  # other modules share this engine: leave no retained pages behind
    assert r["all_finished"] and r["hot_requests"] == 2
    assert r["hot_full_hit_rate_while_retained"] == 1.0
    assert 0 < r["max_retained_pages"] <= r["retained_capacity_pages"]


def test_flood_takes_the_engine_options_with_its_own_defaults():
    args = parse(["flood"])
    assert (args.prefix_cache, args.kv_cache_tokens, args.page_size, args.eviction) == ("radix", 16384, 16, "lru")
    assert (args.retained_pool_fraction, args.max_num_seqs, args.dtype, args.seed) == (0.2, 16, "bfloat16", 0)
    args = parse(["flood", "--cache", "hash", "--pool-tokens", "4096", "--kernel-options", "native_attention=0"])
    assert (args.prefix_cache, args.kv_cache_tokens, args.kernel_options) == ("hash", 4096, "native_attention=0")
