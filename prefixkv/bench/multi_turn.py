"""`prefixkv bench multi-turn`: TTFT per turn of a chat whose every prompt is the whole history + a new message.

Design target: with caching, TTFT of the last turn stays within 1.5x of the first (only the new message and the
previous answer are computed); without caching it grows with the history. Messages are raw random tokens, not a
chat template, so every turn adds exactly turn_tokens + output_len tokens. The history includes the model's own
greedy answers, so a hit on them needs the cache to keep generated tokens' KV, as a real chat does. The ratios are
paired by conversation (its last turn against its first; on against off of the same conversation, run back to back)
and reported as the median of those ratios with every conversation's listed.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.paired import from_ratios, paired, round_ratio
from prefixkv.bench.workloads import median, sampler_for


def register(subparsers) -> None:
    p = subparsers.add_parser("multi-turn", help="TTFT per turn of a growing conversation, cache on vs off")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=100, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--repeats", type=int, default=3, help="conversations per engine; per-turn medians reported")
    common.add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    on_mode, llms = common.on_and_off_engines(args, llm_factory)
    sampler = sampler_for(llms[on_mode], seed=args.seed)
    repeats = max(1, args.repeats)
    conversations = [[sampler.tokens(args.turn_tokens) for _ in range(args.turns)] for _ in range(repeats)]
    for llm in llms.values():
        common.warmup(llm, sampler, prompt_len=args.turn_tokens)

    per_mode: dict[str, list[list[dict]]] = {mode: [] for mode in llms}  # one list of per-turn records per conversation
    for rep, messages in enumerate(conversations):
        for mode in [on_mode, "off"] if rep % 2 == 0 else ["off", on_mode]:  # alternate to cancel drift
            per_mode[mode].append(_converse(llms[mode], messages, args.output_len))

    turns = []
    for t in range(args.turns):
        row = {"turn": t + 1, "prompt_tokens": per_mode[on_mode][0][t]["prompt_tokens"]}
        for mode, convs in per_mode.items():
            row[f"ttft_{mode}_s"] = median([c[t]["ttft"] for c in convs])
            row[f"cached_{mode}"] = convs[0][t]["cached"]
        turns.append(row)
    on_convs, off_convs = per_mode[on_mode], per_mode["off"]
    pairs = {  # per conversation, then the median
        "last_over_first_on": from_ratios([round_ratio(c[-1]["ttft"], c[0]["ttft"]) for c in on_convs]),
        "last_over_first_off": from_ratios([round_ratio(c[-1]["ttft"], c[0]["ttft"]) for c in off_convs]),
        # > 1: caching on answers the last turn first
        "last_turn_on_vs_off": paired(
            [c[-1]["ttft"] for c in on_convs], [c[-1]["ttft"] for c in off_convs], higher_is_better=False
        ),
    }
    answers_same = all(
        a["output"] == b["output"] for ca, cb in zip(per_mode[on_mode], per_mode["off"]) for a, b in zip(ca, cb)
    )
    results: dict[str, Any] = {
        "config": common.run_config(
            args,
            llms[on_mode],
            prefix_cache_on=on_mode,
            turns=args.turns,
            turn_tokens=args.turn_tokens,
            output_len=args.output_len,
            repeats=repeats,
        ),
        "turns": turns,
        "modes": [on_mode, "off"],
        "ratio_last_over_first_on": pairs["last_over_first_on"].median,
        "ratio_last_over_first_off": pairs["last_over_first_off"].median,
        "speedup_last_turn_on_vs_off": pairs["last_turn_on_vs_off"].median,
        "paired": {k: p.as_dict() for k, p in pairs.items()},
        "target_ratio_last_over_first_on": 1.5,
        "answers_identical_on_off": answers_same,
    }
    rows = [
        (r["turn"], r["prompt_tokens"], r[f"cached_{on_mode}"], r[f"ttft_{on_mode}_s"], r["ttft_off_s"]) for r in turns
    ]
    cfg = results["config"]
    common.print_table(
        ["turn", "prompt tokens", f"cached ({on_mode})", f"TTFT {on_mode} s", "TTFT off s"],
        rows,
        title=f"multi-turn: {args.turns} turns x ({args.turn_tokens} user + {args.output_len} answer) "
        f"tokens, median of {repeats} conversations, {cfg['dtype']}, {cfg['num_threads']} threads",
    )
    print(
        f"TTFT turn {args.turns} / turn 1: caching {on_mode} {results['ratio_last_over_first_on']:.2f}x "
        f"(target <= 1.5x), off {results['ratio_last_over_first_off']:.2f}x; last turn off/on "
        f"{results['speedup_last_turn_on_vs_off']:.1f}x (medians of per-conversation ratios); greedy answers "
        f"identical on/off: {answers_same}"
    )
    print(f"  last turn, caching {on_mode} vs off: {pairs['last_turn_on_vs_off'].describe()}")
    return results


def _converse(llm, messages: list[list[int]], output_len: int) -> list[dict]:
    """One conversation from an empty cache: each prompt = everything so far + the next message."""
    llm.reset_prefix_cache()
    history: list[int] = []
    records = []
    for message in messages:
        prompt = history + message
        out = llm.generate([prompt], common.greedy(output_len), use_tqdm=False)[0]
        answer = list(out.outputs[0].token_ids)
        records.append(
            {"prompt_tokens": len(prompt), "ttft": out.metrics.ttft, "cached": out.num_cached_tokens, "output": answer}
        )
        history = prompt + answer
    return records


def plot(results: dict, png_path: str) -> None:
    """TTFT against turn number, one line per cache mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in results["turns"]]
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in results["modes"]:
        label = "caching off" if mode == "off" else f"caching on ({mode})"
        ax.plot(turns, [r[f"ttft_{mode}_s"] * 1000 for r in results["turns"]], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.set_xticks(turns)
    ax.set_title(
        f"multi-turn TTFT ({cfg['turn_tokens']} user + {cfg['output_len']} answer tokens per turn, "
        f"{cfg['dtype']}, {cfg['num_threads']} threads)",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
