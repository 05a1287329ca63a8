"""Routing decisions on hand-made replica states, one policy at a time (no model, no engine: milliseconds)."""

from __future__ import annotations

import pytest

from prefixkv.router import (
    ApproximateRouting,
    LeastLoaded,
    PowerOfTwo,
    ReplicaState,
    RoundRobin,
    Router,
    RouteRequest,
    create_policy,
)

BS = 4  # block size of the cache-aware policies in these tests


def states(*loads: int, usage: tuple[float, ...] = ()) -> list[ReplicaState]:
    return [
        ReplicaState(f"r{i}", waiting=0, running=load, kv_usage=usage[i] if usage else 0.0)
        for i, load in enumerate(loads)
    ]


def prompt(first: int, n: int = 40, **kw) -> RouteRequest:
    return RouteRequest(list(range(first, first + n)), **kw)


def test_round_robin_takes_each_live_replica_in_turn():
    rr = RoundRobin()
    assert [rr.choose(prompt(0), states(5, 0, 9)) for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    assert rr.choose(prompt(0), states(0, 0)) in ("r0", "r1")  # a replica gone: still only live ones


def test_least_loaded_counts_requests_then_kv_usage():
    assert LeastLoaded().choose(prompt(0), states(3, 1, 2)) == "r1"
    assert LeastLoaded().choose(prompt(0), states(1, 1, usage=(0.9, 0.2))) == "r1"


def test_power_of_two_never_picks_the_most_loaded_of_three():
    p2c = PowerOfTwo(seed=1)
    chosen = {p2c.choose(prompt(0), states(1, 50, 2)) for _ in range(50)}
    assert "r1" not in chosen and chosen == {"r0", "r2"}


def test_approximate_sends_a_prompt_back_where_its_prefix_went():
    policy = ApproximateRouting(block_size=BS)
    router = Router(policy)
    first = router.route(prompt(0), states(0, 0, 0))
    router.route(prompt(1000), states(0, 0, 0))  # another prefix goes to the smallest (empty) tree
    assert policy.trees.tree_tokens(first) == 40
    follow_up = RouteRequest(list(range(0, 40)) + [7] * 20)  # 40 of 60 tokens match: 0.67 > 0.3
    assert router.route(follow_up, states(0, 0, 0)) == first


def test_approximate_below_the_match_threshold_takes_the_smallest_tree():
    policy = ApproximateRouting(block_size=BS)
    policy.on_routed(prompt(0, 80), "r0")
    policy.on_routed(prompt(500, 20), "r1")
    weak = RouteRequest(list(range(0, 8)) + [9] * 32)  # 8 of 40 tokens match r0: 0.2 <= 0.3
    assert policy.choose(weak, states(0, 0, 0)) == "r2"
    assert policy.choose(weak, states(0, 0)) == "r1"  # without r2: r1's tree (20) is smaller than r0's (80)


@pytest.mark.parametrize(
    ("loads", "balanced"),
    [((100, 10), False), ((70, 10), True), ((200, 140), True)],  # imbalanced needs diff > 64 AND max > 1.5 min
)
def test_approximate_balances_only_when_both_thresholds_are_crossed(loads, balanced):
    policy = ApproximateRouting(block_size=BS)
    policy.on_routed(prompt(0), "r0")
    chosen = policy.choose(prompt(0), states(*loads))
    assert chosen == ("r0" if balanced else "r1")


def test_approximate_keys_include_the_tenant_salt_and_the_adapter():
    policy = ApproximateRouting(block_size=BS)
    policy.on_routed(prompt(0, cache_salt="tenant-a"), "r0")
    policy.on_routed(prompt(900, 80), "r1")  # r1's tree is the bigger one
    assert policy.choose(prompt(0, cache_salt="tenant-a"), states(0, 0)) == "r0"
    assert policy.choose(prompt(0, cache_salt="tenant-b"), states(0, 0)) == "r0"  # no match: smallest tree (r0)
    m = policy.trees.matched_blocks(prompt(0, cache_salt="tenant-b").block_hashes(BS), ["r0", "r1"])
    assert m == {"r0": 0, "r1": 0}
    assert policy.trees.matched_blocks(prompt(0, lora_id="x").block_hashes(BS), ["r0"]) == {"r0": 0}


def test_approximate_trees_are_lru_bounded_and_evict_leaves_first():
    policy = ApproximateRouting(block_size=BS, max_tree_tokens=48)  # 12 blocks
    policy.on_routed(prompt(0, 40), "r0")  # 10 blocks
    policy.on_routed(prompt(500, 16), "r0")  # 4 more: the 2 oldest leaves of the first prompt go
    assert policy.trees.tree_tokens("r0") == 48 and policy.trees.evicted_blocks == 2
    assert policy.trees.matched_blocks(prompt(0, 40).block_hashes(BS), ["r0"]) == {"r0": 8}


def test_a_removed_replica_leaves_the_approximate_tree():
    router = Router(ApproximateRouting(block_size=BS))
    assert router.route(prompt(0), states(0, 0)) == "r0"
    router.remove_replica("r0")
    assert router.policy.trees.tree_tokens("r0") == 0  # type: ignore[attr-defined]
    assert router.route(prompt(0), [ReplicaState("r1")]) == "r1"


def test_a_session_key_pins_its_conversation_until_the_replica_goes():
    router = Router(LeastLoaded())
    assert router.route(prompt(0, session_key="chat-1"), states(0, 5)) == "r0"
    assert router.route(prompt(77, session_key="chat-1"), states(9, 0)) == "r0"  # pinned despite the load
    assert router.route(prompt(77), states(9, 0)) == "r1"  # no key: the policy decides
    router.remove_replica("r0")
    assert router.route(prompt(0, session_key="chat-1"), states(0, 5)[1:]) == "r1"


def test_a_target_replica_outranks_pins_and_policy_while_it_lives():
    """A request naming a cache entry goes to the entry's holder, whatever its load or session pin, and its
    session follows it; once the holder is gone it routes as if untargeted (that replica answers 'not found')."""
    router = Router(LeastLoaded())
    assert router.route(prompt(0, session_key="chat-1"), states(0, 5)) == "r0"
    assert router.route(prompt(0, session_key="chat-1", target_replica="r1"), states(0, 5)) == "r1"
    assert router.route(prompt(0, session_key="chat-1"), states(0, 5)) == "r1"  # the session followed the entry
    assert router.route(prompt(0, target_replica="gone"), states(3, 0)) == "r1"  # dead holder: the policy decides


def test_the_router_records_the_prefix_another_replica_holds_for_the_one_it_chose():
    """held_elsewhere_tokens (the replica's `routed` miss cause): the longest prefix another live replica's tree
    holds, never the chosen one's own; 0 from a policy that keeps no index."""
    router = Router(ApproximateRouting(block_size=BS))
    first = prompt(0)
    owner = router.route(first, states(0, 0))
    repeat = prompt(0)
    assert router.route(repeat, states(0, 0)) == owner
    assert first.held_elsewhere_tokens == repeat.held_elsewhere_tokens == 0  # only the chosen replica holds it
    other = router.route(prompt(500, session_key="s"), states(0, 0))  # the emptier tree: the other replica
    assert other != owner
    pinned = RouteRequest(list(range(30)) + [999] * 10, session_key="s")  # 7 blocks of 4 shared with `first`
    assert router.route(pinned, states(0, 0)) == other and pinned.held_elsewhere_tokens == 28
    blind = prompt(0)
    blind.held_elsewhere_tokens = 5
    Router(RoundRobin()).route(blind, states(0, 0))
    assert blind.held_elsewhere_tokens == 0


def test_routing_with_no_replica_or_an_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="no live replica"):
        Router(RoundRobin()).route(prompt(0), [])
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        create_policy("random")
