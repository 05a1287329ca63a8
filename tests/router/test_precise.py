"""The precise router's block index applying KV events, and its cost trading a prefix hit against load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixkv.router import BlockIndex, PreciseRouting, ReplicaState, Router, RouteRequest
from tests.shared_data import MOONCAKE, shared_trace

BS = 4
TUNING_SWEEP = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "routing" / "tuning_sweep.json"


def stored(hashes: list[int], parent: int | None = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, [0] * (BS * len(hashes)), BS, medium=medium)


def test_the_index_applies_stored_removed_cleared_and_a_dead_replica():
    index = BlockIndex()
    index.apply("a", [stored([1, 2, 3]), stored([4], parent=3)])
    index.apply("b", [stored([1, 2]), stored([9], medium="CPU")])  # another tier is not a device hit
    assert index.matched_blocks([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    index.apply("a", [BlockRemoved([3])])  # a lookup stops at the first miss: block 4 is unreachable
    assert index.matched_blocks([1, 2, 3, 4], ["a", "b"]) == {"a": 2, "b": 2}
    assert index.blocks("a") == {1, 2, 4} and index.blocks("b") == {1, 2}
    index.apply("b", [AllBlocksCleared()])
    assert index.matched_blocks([1, 2], ["a", "b"]) == {"a": 2, "b": 0} and index.num_blocks("b") == 0
    index.apply("b", [stored([1])])
    index.remove_replica("a")
    assert index.matched_blocks([1, 2], ["a", "b"]) == {"a": 0, "b": 1} and index.blocks("a") == set()


def test_precise_routes_to_the_replica_holding_the_prefix_unless_it_is_much_busier():
    policy = PreciseRouting(block_size=BS, decode_weight=1.0, queue_weight=1.0)  # Dynamo's weights
    router = Router(policy)
    request = RouteRequest(list(range(40)))  # 10 blocks
    hashes = request.block_hashes(BS)
    router.kv_events("r1", [stored(hashes[:8])])
    idle = [ReplicaState("r0"), ReplicaState("r1")]
    assert policy.costs(request, idle) == {"r0": 10.0, "r1": 2.0}
    assert policy.choose(request, idle) == "r1"
    busy = [ReplicaState("r0"), ReplicaState("r1", running=3, active_blocks=9)]  # 2 + 9 > 10
    assert policy.choose(request, busy) == "r0"
    queued = [ReplicaState("r0"), ReplicaState("r1", waiting=2, pending_prefill_tokens=40)]  # 2 + 10 > 10
    assert policy.choose(request, queued) == "r0"
    default = PreciseRouting(block_size=BS)  # the defaults: misses 1, queued prefill 0.02, decode 0.001
    default.on_kv_events("r1", [stored(hashes[:8])])
    assert default.choose(request, busy) == "r1" and default.choose(request, queued) == "r1"
    assert default.costs(request, queued) == {"r0": 10.0, "r1": 2.2}
    assert default.costs(request, busy) == pytest.approx({"r0": 10.0, "r1": 2.009})  # 9 blocks to decode


def test_the_default_weights_are_the_ones_the_tuning_sweep_chose():
    """docs/benchmarks/routing/tuning_sweep.json (tune_precise_weights.py there) chose them on the tuning slice."""
    chosen = json.loads(TUNING_SWEEP.read_text())["chosen"]
    policy = PreciseRouting()
    assert (policy.prefill_weight, policy.queue_weight, policy.decode_weight) == (
        1.0,
        chosen["queue_weight"],
        chosen["decode_weight"],
    )


def test_the_weights_were_tuned_on_a_slice_that_ends_before_the_held_out_one_begins():
    """The tuning slice's last request arrives before the held-out slice's first: no request is in both."""
    from prefixkv.sim.traces import TraceScaling, load_trace, scale_trace

    path = shared_trace(MOONCAKE)

    sweep = json.loads(TUNING_SWEEP.read_text())
    tuning, held_out = sweep["tuning_slice"], sweep["held_out_slice"]
    assert tuning["args"] == ["--max-requests", str(tuning["max_requests"])] and tuning["start_s"] == 0
    assert held_out["args"] == ["--start-s", str(held_out["start_s"]), "--max-requests", str(held_out["max_requests"])]
    trace = load_trace(str(path))
    assert trace.requests[0].arrival_s == 0  # arrivals are trace seconds from the first request
    tuned = scale_trace(trace, TraceScaling(max_requests=tuning["max_requests"]))  # rebased to 0: trace seconds
    assert len(tuned) == tuning["max_requests"] and tuned[-1].arrival_s < held_out["start_s"]
    held = scale_trace(trace, TraceScaling(start_s=held_out["start_s"], max_requests=held_out["max_requests"]))
    assert len(held) == held_out["max_requests"]


def test_a_prompt_routed_but_not_yet_computed_draws_its_followers():
    policy = PreciseRouting(block_size=BS)
    router = Router(policy)
    first = RouteRequest(list(range(40)))
    fleet = [ReplicaState("r0"), ReplicaState("r1", cached_blocks=0)]
    router.kv_events("r0", [stored([12345])])  # r0 caches something else: r1 is the emptier one
    assert router.route(first, fleet) == "r1"
    follower = RouteRequest(list(range(40)) + [7] * 8)
    assert policy.matched_blocks(follower, ["r0", "r1"]) == {"r0": 0, "r1": 10}  # no event yet: in flight
    assert router.route(follower, fleet) == "r1"
    router.kv_events("r1", [stored(first.block_hashes(BS))])  # computed: held now, the follower's 2 still coming
    assert policy.matched_blocks(follower, ["r0", "r1"]) == {"r0": 0, "r1": 12}
    router.kv_events("r1", [BlockRemoved(first.block_hashes(BS)[5:])])
    assert policy.matched_blocks(follower, ["r0", "r1"])["r1"] == 5  # an event confirmed it: no longer in flight
    router.finished(follower, "r1")  # its last 2 blocks were never stored: no longer expected
    assert policy.num_in_flight_blocks == 0 and policy.matched_blocks(follower, ["r1"]) == {"r1": 5}
    bounded = PreciseRouting(block_size=BS, max_in_flight_blocks=4)
    bounded.on_routed(first, "r1")
    assert bounded.matched_blocks(first, ["r1"]) == {"r1": 0}  # only the 4 newest entries are kept


def test_the_router_records_what_the_index_says_another_replica_holds():
    """held_elsewhere_tokens for the replica chosen: another replica's stored blocks, or blocks it is computing
    for a prompt routed there; asked before on_routed counts the prompt as the chosen replica's."""
    router = Router(PreciseRouting(block_size=BS))
    request = RouteRequest(list(range(40)))
    router.kv_events("r1", [stored(request.block_hashes(BS)[:8])])
    busy_r1 = [ReplicaState("r0"), ReplicaState("r1", running=100)]  # imbalanced: the least loaded first
    assert router.route(request, busy_r1) == "r0" and request.held_elsewhere_tokens == 32
    busy_r0 = [ReplicaState("r0", running=100), ReplicaState("r1")]
    again = RouteRequest(list(range(40)))
    assert router.route(again, busy_r0) == "r1" and again.held_elsewhere_tokens == 40  # r0 computes all 10
    alone = RouteRequest(list(range(40)))
    assert router.route(alone, [ReplicaState("r0")]) == "r0" and alone.held_elsewhere_tokens == 0


def test_a_clearly_imbalanced_fleet_goes_to_the_least_loaded_first():
    policy = PreciseRouting(block_size=BS)
    request = RouteRequest(list(range(40)))
    policy.on_kv_events("r1", [stored(request.block_hashes(BS))])
    assert policy.choose(request, [ReplicaState("r0", running=10), ReplicaState("r1", running=70)]) == "r1"
    assert policy.choose(request, [ReplicaState("r0", running=5), ReplicaState("r1", running=70)]) == "r0"


def test_a_dead_replica_drops_out_of_the_precise_index():
    router = Router(PreciseRouting(block_size=BS))
    request = RouteRequest(list(range(40)))
    router.kv_events("r1", [stored(request.block_hashes(BS))])
    router.route(RouteRequest(list(range(100, 140))), [ReplicaState("r1")])  # in flight on r1
    router.remove_replica("r1")
    assert router.policy.index.num_blocks("r1") == 0  # type: ignore[attr-defined]
    assert router.policy.matched_blocks(RouteRequest(list(range(100, 140))), ["r1"]) == {"r1": 0}  # type: ignore
    assert router.route(request, [ReplicaState("r0")]) == "r0"


def test_salted_prompts_hash_apart_so_a_tenant_hits_only_its_own_blocks():
    policy = PreciseRouting(block_size=BS)
    mine = RouteRequest(list(range(40)), cache_salt="tenant-a")
    policy.on_kv_events("r1", [stored(mine.block_hashes(BS))])
    theirs = RouteRequest(list(range(40)), cache_salt="tenant-b")
    replicas = [ReplicaState("r0"), ReplicaState("r1")]
    assert policy.choose(mine, replicas) == "r1"
    assert policy.costs(theirs, replicas) == {"r0": 10.0, "r1": 10.0}
