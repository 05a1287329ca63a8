"""`prefixkv bench page-size`: what radix page size 1, 16 and 64 cost in hits when prefixes end off page boundaries.

A page is the unit of matching: a prefix of 1000 tokens is cached as 1000 tokens with page 1, 992 with page 16
and 960 with page 64. Multi-turn conversations make this recur at every turn: turn t's prompt extends turn t-1's
at an arbitrary offset. Larger pages mean fewer tree nodes and page-table entries (and faster attention kernels),
smaller ones more hits.

SIMULATED like `bench thrash`: the real Scheduler and radix cache, no model; throughput is cost-model time.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from prefixkv.bench.thrash import SIMULATED
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.sim.simulator import SimRequest, make_policy, simulate, summarize_run


def chat_workload(
    num_conversations: int = 16,
    turns: int = 4,
    system_len: int = 1000,
    question_len: int = 37,
    answer_len: int = 23,
    output_len: int = 8,
    gap_steps: int = 40,
    seed: int = 0,
) -> list[SimRequest]:
    """Conversations sharing one system prompt; turn t's prompt is turn t-1's plus an answer and a question, so
    each turn's cached prefix ends at a length that is not a multiple of 16 or 64."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(system_len)]
    out = []
    for c in range(num_conversations):
        prompt = list(system)
        for t in range(turns):
            if t:
                prompt = prompt + [rng.randrange(1, 32000) for _ in range(answer_len)]
            prompt = prompt + [rng.randrange(1, 32000) for _ in range(question_len)]
            out.append(SimRequest(c + t * gap_steps, list(prompt), output_len, f"c{c}"))
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "page-size", help="radix page size 1/16/64: hit tokens on prefixes off page boundaries (simulated, no model)"
    )
    p.add_argument("--page-sizes", default="1,16,64")
    p.add_argument("--num-conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--question-len", type=int, default=37)
    p.add_argument("--answer-len", type=int, default=23)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--pool-tokens", type=int, default=1 << 17, help="large enough that nothing is evicted")
    p.add_argument("--policy", default="lpm")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from prefixkv.bench.common import print_table

    work = chat_workload(
        args.num_conversations,
        args.turns,
        args.system_len,
        args.question_len,
        args.answer_len,
        args.output_len,
        seed=args.seed,
    )
    results: dict[str, Any] = {
        "mode": SIMULATED,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "page_sizes": {},
    }
    rows = []
    for ps in [int(x) for x in args.page_sizes.split(",") if x.strip()]:
        kv = RadixPrefixCache(max(1, args.pool_tokens // ps), ps)
        t0 = time.perf_counter()
        res = simulate(kv, make_policy(args.policy), work, max_num_seqs=16, max_num_batched_tokens=4096)
        kv.check_invariants()
        s = summarize_run(res, kv)
        s["tree_nodes"] = kv.tree.num_nodes
        s["wall_s"] = time.perf_counter() - t0
        results["page_sizes"][str(ps)] = s
        rows.append(
            [ps, s["hit_tokens"], s["token_hit_rate"], s["computed_tokens"], s["sim_output_tok_s"], s["tree_nodes"]]
        )
    print_table(
        ["page size", "hit tokens", "hit rate", "computed tokens", "sim out tok/s", "tree nodes"],
        rows,
        title=f"page-size ({SIMULATED}); system prompt {args.system_len} tokens",
    )
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["page_sizes"])
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(sizes, [results["page_sizes"][s]["hit_tokens"] for s in sizes])
    ax.set_xlabel("radix page size")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_title("page size (simulated)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
