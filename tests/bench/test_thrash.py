import argparse

import pytest

from prefixkv.bench import page_size, schedule_cost, thrash


def parse(module, argv):
    p = argparse.ArgumentParser()
    module.register(p.add_subparsers())
    return p.parse_args(argv)


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_thrash_targets_hold_in_a_small_simulation(cache):
    args = parse(thrash, ["thrash", "--requests-per-group", "40", "--arrival-every", "3",
                          "--max-wait-steps", "24", "--cache", cache])
    r = args.func(args)
    p = r["policies"]
    assert r["mode"].startswith("simulated")
    assert p["lpm"]["of_optimal"] >= 0.96
    assert p["dfs-weight"]["of_optimal"] >= 0.96
    assert p["fcfs"]["token_hit_rate"] < 0.6 * p["lpm"]["token_hit_rate"]  # fcfs thrashes
    assert p["bounded-lpm"]["of_optimal"] >= 0.9
    assert p["bounded-lpm"]["p99_wait_steps"] < p["lpm"]["p99_wait_steps"] / 2
    assert p["bounded-lpm"]["max_wait_steps"] <= 24 + 60  # the bound, then the running hot requests drain


def test_page_size_and_schedule_cost_run():
    r = page_size.run(parse(page_size, ["page-size", "--num-conversations", "4", "--turns", "3", "--system-len",
                                        "200"]))
    hits = [r["page_sizes"][s]["hit_tokens"] for s in ("1", "16", "64")]
    assert hits[0] >= hits[1] >= hits[2] > 0
    r = schedule_cost.run(parse(schedule_cost, ["schedule-cost", "--sizes", "64", "--prefix-len", "64",
                                                "--num-prefixes", "4", "--repeats", "1"]))
    assert len(r["cases"]) == 2 * 4 and all(c["step_ms"] >= 0 for c in r["cases"])
