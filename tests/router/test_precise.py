"""The precise router's block index applying KV events, and its cost trading a prefix hit against load."""

from __future__ import annotations

from prefixkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixkv.router import BlockIndex, PreciseRouting, ReplicaState, Router, RouteRequest

BS = 4


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
    policy = PreciseRouting(block_size=BS)
    router = Router(policy)
    request = RouteRequest(list(range(40)))  # 10 blocks
    hashes = request.block_hashes(BS)
    router.kv_events("r1", [stored(hashes[:8])])
    idle = [ReplicaState("r0"), ReplicaState("r1")]
    assert policy.costs(request, idle) == {"r0": 10.0, "r1": 2.0}
    assert router.route(request, idle) == "r1"
    busy = [ReplicaState("r0"), ReplicaState("r1", running=3, active_blocks=9)]  # 2 + 9 > 10
    assert router.route(request, busy) == "r0"
    light = PreciseRouting(block_size=BS, decode_weight=0.5)  # weights are the trade-off's knobs
    light.on_kv_events("r1", [stored(hashes[:8])])
    assert light.choose(request, busy) == "r1"  # 2 + 4.5 < 10


def test_a_dead_replica_drops_out_of_the_precise_index():
    router = Router(PreciseRouting(block_size=BS))
    request = RouteRequest(list(range(40)))
    router.kv_events("r1", [stored(request.block_hashes(BS))])
    router.remove_replica("r1")
    assert router.policy.index.num_blocks("r1") == 0  # type: ignore[attr-defined]
    assert router.route(request, [ReplicaState("r0")]) == "r0"


def test_salted_prompts_hash_apart_so_a_tenant_hits_only_its_own_blocks():
    policy = PreciseRouting(block_size=BS)
    mine = RouteRequest(list(range(40)), cache_salt="tenant-a")
    policy.on_kv_events("r1", [stored(mine.block_hashes(BS))])
    theirs = RouteRequest(list(range(40)), cache_salt="tenant-b")
    replicas = [ReplicaState("r0"), ReplicaState("r1")]
    assert policy.choose(mine, replicas) == "r1"
    assert policy.costs(theirs, replicas) == {"r0": 10.0, "r1": 10.0}
