"""`prefixkv bench agent-tools`: what a stable tool block is worth to an agent workload (issue 41's numbers).

Agent sessions share a long tool block (here 2-4k tokens of function definitions) and each session makes calls
and reads their results, turn after turn: every request is the tool block, the session's system prompt and its
conversation so far, and the answer a forced tool call (the grammar of prefixkv/tools). Run twice from an empty
cache: with the tool list in one order on every request (prefixkv's canonical JSON keeps the block token for
token the same), and with the list shuffled per request, the change upstream users report as their most frequent
agent cache miss. The sessions take turns (each request alone, so TTFT is the request's own prefill), and the
modes alternate their order round by round; reported per mode: the hit rate (cached prompt tokens over prompt
tokens, from the engine's per-request count) and TTFT, and the median of the per-round TTFT ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.paired import paired
from prefixkv.bench.workloads import median

DOMAINS = [
    "calendar",
    "email",
    "files",
    "tickets",
    "billing",
    "inventory",
    "shipping",
    "weather",
    "maps",
    "search",
    "contacts",
    "notes",
    "reports",
    "database",
    "deployments",
    "alerts",
]
ACTIONS = ["get", "list", "create", "update"]


def tools(count: int) -> list[Any]:
    """count function definitions shaped like an agent's (a sentence of description, a few typed arguments)."""
    from prefixkv.tools.spec import Tool

    out = []
    for i in range(count):
        domain, action = DOMAINS[i // len(ACTIONS) % len(DOMAINS)], ACTIONS[i % len(ACTIONS)]
        out.append(
            Tool(
                name=f"{action}_{domain}_{i}",
                description=(
                    f"{action.capitalize()} {domain} records for the current user. Use it when the user asks about "
                    f"their {domain}; results come back as JSON with one object per record, newest first."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": f"what to look for in {domain}", "maxLength": 24},
                        "limit": {"type": "integer", "description": "most records to return", "minimum": 1},
                        "include_archived": {"type": "boolean", "description": "also search archived records"},
                    },
                    "required": ["query"],
                },
            )
        )
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("agent-tools", help="hit rate and TTFT with the tool block stable vs reordered")
    p.add_argument("--tools", type=int, default=24, help="function definitions in the tool block")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=3, help="calls per session (each reads the previous result)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs both modes, in alternating order")
    p.add_argument("--call-tokens", type=int, default=64, help="most tokens per call")
    common.add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16")


def _mode(llm, offered: list[Any], sessions: int, turns: int, shuffle: bool, call_tokens: int, seed: int) -> dict:
    """One pass of the workload from an empty cache: every session's turns, the sessions taking turns."""
    from prefixkv.sampling_params import SamplingParams
    from prefixkv.tools.grammar import tool_constraint
    from prefixkv.tools.parse import split_answer
    from prefixkv.tools.prompt import render_messages
    from prefixkv.tools.spec import ToolChoice

    rng = random.Random(seed)
    choice = ToolChoice(mode="required", parallel=False)
    conversations: list[list[dict[str, Any]]] = [
        [
            {"role": "system", "content": f"You are agent {s}. Call one function per turn."},
            {"role": "user", "content": f"Find what is new in my {DOMAINS[s % len(DOMAINS)]}."},
        ]
        for s in range(sessions)
    ]
    llm.reset_prefix_cache()
    prompt_tokens = cached = 0
    ttfts: list[float] = []
    tok = llm.get_tokenizer()
    for turn in range(turns):
        for s, messages in enumerate(conversations):
            order = list(offered)
            if shuffle:
                rng.shuffle(order)
            params = SamplingParams(
                temperature=0, max_tokens=call_tokens, structured_outputs=tool_constraint(order, choice, None)
            )
            ids = tok.encode_chat(render_messages(messages, order))
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            prompt_tokens += len(ids)
            cached += out.num_cached_tokens
            if out.metrics is not None and out.metrics.ttft is not None:
                ttfts.append(out.metrics.ttft)
            call_id = f"call_{s}_{turn}"
            _, calls = split_answer(out.outputs[0].text, lambda: call_id)  # noqa: B023 - called before the next turn
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            for call in calls:
                messages.append({"role": "tool", "content": f'{{"records":[],"checked":"{call.name}"}}'})
    return {
        "requests": sessions * turns,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt_tokens, 4),
        "ttft_s": {"median": statistics.median(ttfts), "mean": statistics.fmean(ttfts), "max": max(ttfts)},
    }


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    factory = common.factory_for(args, llm_factory)
    llm = factory(prefix_cache="hash")
    offered = tools(args.tools)
    from prefixkv.tools.prompt import tool_block

    block_tokens = len(llm.get_tokenizer().hf.encode(tool_block(offered), add_special_tokens=False))
    rounds: dict[str, list[dict]] = {"stable": [], "reordered": []}
    for r in range(max(1, args.rounds)):
        for mode in ["stable", "reordered"] if r % 2 == 0 else ["reordered", "stable"]:
            rounds[mode].append(
                _mode(llm, offered, args.sessions, args.turns, mode == "reordered", args.call_tokens, args.seed or 0)
            )
    ttft = paired(
        [m["ttft_s"]["median"] for m in rounds["stable"]],
        [m["ttft_s"]["median"] for m in rounds["reordered"]],
        higher_is_better=False,
    )
    summary = {
        mode: {
            "hit_rate": median([m["hit_rate"] for m in runs]),
            "ttft_median_s": median([m["ttft_s"]["median"] for m in runs]),
        }
        for mode, runs in rounds.items()
    }
    for mode, row in summary.items():
        print(f"{mode}: hit rate {row['hit_rate']:.1%}, median TTFT {row['ttft_median_s'] * 1000:.0f} ms")
    print(f"TTFT, stable tool block against reordered: {ttft.describe(2)}")
    return {
        "config": common.run_config(
            args, llm, tools=args.tools, tool_block_tokens=block_tokens, sessions=args.sessions, turns=args.turns
        ),
        "rounds": rounds,
        "summary": summary,
        "ttft_stable_vs_reordered": ttft.as_dict(),
    }
