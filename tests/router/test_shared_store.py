"""The precise router with a shared KV store: the store's index from REMOTE events, blocks it holds costed at the
store's load weight, and no change at all for a fleet whose store never published."""

from __future__ import annotations

import pytest

from prefixkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixkv.router import PreciseRouting, ReplicaState, RouteRequest
from prefixkv.router.store_index import MEDIUM_REMOTE, SharedStoreIndex

BS = 4


def stored(hashes: list[int], medium: str | None = "GPU", size: int = BS) -> BlockStored:
    return BlockStored(hashes, None, [0] * (size * len(hashes)), size, medium=medium)


def test_the_store_index_takes_remote_events_only_and_the_pool_index_ignores_them():
    request = RouteRequest(list(range(40)))  # 10 blocks of 4
    hashes = request.block_hashes(BS)
    index = SharedStoreIndex()
    index.apply([stored(hashes[:6], medium="GPU"), stored(hashes[:3], medium="CPU"), AllBlocksCleared()])
    assert not index.present and index.held_tokens(request, "sha256") == 0
    index.apply([stored(hashes[:6], medium=MEDIUM_REMOTE)])
    assert index.present and index.held_tokens(request, "sha256") == 24
    index.apply([BlockRemoved([hashes[2]], MEDIUM_REMOTE), BlockRemoved([hashes[0]], "GPU")])
    assert index.held_tokens(request, "sha256") == 8  # the store's lookup stops at the chunk it dropped
    with pytest.raises(ValueError, match="8-token chunks"):
        index.apply([stored([1], medium=MEDIUM_REMOTE, size=8)])

    policy = PreciseRouting(block_size=BS)
    policy.on_kv_events("r0", [stored(hashes[:2]), stored(hashes[:8], medium=MEDIUM_REMOTE)])
    assert policy.index.blocks("r0") == set(hashes[:2])  # the pool's blocks only: the store is everyone's
    assert policy.store.num_chunks == 8


def test_chunks_larger_than_pages_are_matched_at_the_chunk_size():
    request = RouteRequest(list(range(40)))
    chunks = request.block_hashes(16)  # two whole 16-token chunks in 40 tokens
    policy = PreciseRouting(block_size=BS, remote_block_weight=0.5)
    policy.on_kv_events("store", [stored(chunks, medium=MEDIUM_REMOTE, size=16)])
    assert policy.store.held_tokens(request, "sha256") == 32
    assert policy.costs(request, [ReplicaState("r0")]) == {"r0": pytest.approx(2 + 0.5 * 8)}


def test_a_replica_lacking_what_the_store_holds_pays_the_load_weight_not_a_recompute():
    request = RouteRequest(list(range(40)))  # 10 blocks
    hashes = request.block_hashes(BS)
    policy = PreciseRouting(block_size=BS, remote_block_weight=0.1, decode_weight=0.0)
    policy.on_kv_events("r1", [stored(hashes[:8])])
    idle = [ReplicaState("r0"), ReplicaState("r1")]
    assert policy.costs(request, idle) == {"r0": 10.0, "r1": 2.0}  # no store: r0 recomputes 10 blocks
    policy.on_kv_events("r1", [stored(hashes[:8], medium=MEDIUM_REMOTE)])  # r1's writer stored them in the store
    assert policy.costs(request, idle) == pytest.approx({"r0": 2 + 0.8, "r1": 2.0})
    assert policy.choose(request, idle) == "r1"  # the pool hit is still the cheapest
    # r1 has 50 blocks of prefill queued: 1 block of cost at the default queue weight, more than the 0.8 that
    # loading from the store adds on r0; without the store r0 would recompute 10 and r1 would still win
    queued = [ReplicaState("r0"), ReplicaState("r1", waiting=2, pending_prefill_tokens=200)]
    assert policy.costs(request, queued) == pytest.approx({"r0": 2.8, "r1": 3.0})
    assert policy.choose(request, queued) == "r0"
    alone = PreciseRouting(block_size=BS, remote_block_weight=0.1, decode_weight=0.0)
    alone.on_kv_events("r1", [stored(hashes[:8])])
    assert alone.choose(request, queued) == "r1"


def test_without_remote_events_the_costs_are_the_ones_before_the_store():
    """The defaults' costs of test_precise.py, with the store's weight set to anything: never read."""
    request = RouteRequest(list(range(40)))
    hashes = request.block_hashes(BS)
    queued = [ReplicaState("r0"), ReplicaState("r1", waiting=2, pending_prefill_tokens=40)]
    busy = [ReplicaState("r0"), ReplicaState("r1", running=3, active_blocks=9)]
    for options in ({}, {"remote_block_weight": 5.0}):
        policy = PreciseRouting(block_size=BS, **options)
        policy.on_kv_events("r1", [stored(hashes[:8])])
        assert policy.costs(request, queued) == {"r0": 10.0, "r1": 2.2}
        assert policy.costs(request, busy) == pytest.approx({"r0": 10.0, "r1": 2.009})
        assert policy.choose(request, queued) == "r1" and policy.choose(request, busy) == "r1"


def test_remote_events_confirm_no_routed_block_in_flight():
    """A routed prompt's blocks stay expected at its replica until that replica's pool stores them: the store
    holding them (another replica's write) says nothing about this replica's pool."""
    request = RouteRequest(list(range(16)))
    hashes = request.block_hashes(BS)
    policy = PreciseRouting(block_size=BS)
    policy.on_routed(request, "r0")
    assert policy.num_in_flight_blocks == 4
    policy.on_kv_events("r0", [stored(hashes, medium=MEDIUM_REMOTE)])
    assert policy.num_in_flight_blocks == 4
    policy.on_kv_events("r0", [stored(hashes)])
    assert policy.num_in_flight_blocks == 0
