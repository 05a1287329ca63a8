"""`prefixkv bench system-prompt`: TTFT of a long shared system prompt, cold versus warm, caching on versus off.

The design target is a warm TTFT at least 20x below the cold one (with a 2048-token system prompt and a 50-token
question only 1/40 of the prompt needs computing). Each repetition empties the cache, sends system + question A
(cold), then system + question B (warm: only the question is new). The same pair goes to an engine with caching
off, which must show no speed-up. TTFT = first_token_time - arrival_time of a max_tokens=1 request. Every ratio
is paired by repetition (cold / warm of one repetition; on against off of one repetition, the two runs seconds
apart on the same questions) and reported as the median of those ratios, with every repetition's listed.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.paired import Paired, from_ratios, paired
from prefixkv.bench.workloads import median, ratio, sampler_for


def register(subparsers) -> None:
    p = subparsers.add_parser("system-prompt", help="TTFT with a long system prompt: cold vs warm, cache on vs off")
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5, help="cold/warm pairs per engine; medians reported")
    common.add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    on_mode, llms = common.on_and_off_engines(args, llm_factory)
    sampler = sampler_for(llms[on_mode], seed=args.seed)
    system = sampler.tokens(args.system_tokens)
    repeats = max(1, args.repeats)
    questions = [sampler.tokens(args.question_tokens) for _ in range(2 * repeats)]
    prompt_len = args.system_tokens + args.question_tokens
    for llm in llms.values():  # warm-up at full length: the first long prefill pays for allocator growth
        common.warmup(llm, sampler, prompt_len=prompt_len)

    samples: dict[str, dict[str, list[float]]] = {
        mode: {"cold": [], "warm": [], "cold_cached": [], "warm_cached": []} for mode in llms
    }
    for rep in range(repeats):
        for mode in [on_mode, "off"] if rep % 2 == 0 else ["off", on_mode]:  # alternate to cancel drift
            llm, s = llms[mode], samples[mode]
            llm.reset_prefix_cache()
            for phase, question in (("cold", questions[2 * rep]), ("warm", questions[2 * rep + 1])):
                seconds, cached = _ttft(llm, system + question)
                s[phase].append(seconds)
                s[f"{phase}_cached"].append(cached)

    ttft: dict[str, dict[str, Any]] = {
        mode: {
            "cold_s": median(s["cold"]),
            "warm_s": median(s["warm"]),
            "cold_samples_s": s["cold"],
            "warm_samples_s": s["warm"],
            "cold_cached_tokens": s["cold_cached"],
            "warm_cached_tokens": s["warm_cached"],
        }
        for mode, s in samples.items()
    }
    son, soff = samples[on_mode], samples["off"]
    pairs: dict[str, Paired] = {  # per repetition, then the median; > 1: the first side is faster
        "warm_vs_cold_on": paired(son["warm"], son["cold"], higher_is_better=False),
        "warm_vs_cold_off": paired(soff["warm"], soff["cold"], higher_is_better=False),
        "warm_on_vs_off": paired(son["warm"], soff["warm"], higher_is_better=False),
        "cold_on_vs_off": paired(son["cold"], soff["cold"], higher_is_better=False),
    }
    results = {
        "config": common.run_config(
            args,
            llms[on_mode],
            prefix_cache_on=on_mode,
            system_tokens=args.system_tokens,
            question_tokens=args.question_tokens,
            repeats=repeats,
        ),
        "ttft": ttft,
        "speedup_warm_vs_cold_on": pairs["warm_vs_cold_on"].median,
        "speedup_warm_vs_cold_off": pairs["warm_vs_cold_off"].median,
        "speedup_warm_on_vs_off": pairs["warm_on_vs_off"].median,
        # on's cold TTFT over off's, per repetition (> 1: caching on costs time), the median
        "cold_overhead_on_vs_off": from_ratios([ratio(a, b) for a, b in zip(son["cold"], soff["cold"])]).median,
        "paired": {k: p.as_dict() for k, p in pairs.items()},
        "target_speedup": 20.0,
        "reference": {
            "label": common.REFERENCE_LABEL,
            "cold_s": common.REFERENCE["system_prompt_cold_ttft_s"],
            "warm_s": common.REFERENCE["system_prompt_warm_ttft_s"],
        },
    }
    _print(results, on_mode)
    return results


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    out = llm.generate([prompt], common.greedy(1), use_tqdm=False)[0]
    return out.metrics.ttft, out.num_cached_tokens


def _print(results: dict, on_mode: str) -> None:
    cfg, ttft, ref = results["config"], results["ttft"], results["reference"]

    def cold_over_warm(mode: str, t: dict) -> float:  # the median of the per-repetition cold / warm
        p = results.get("paired", {}).get("warm_vs_cold_" + ("on" if mode == on_mode else "off"))
        return p["median"] if p and p["median"] is not None else ratio(t["cold_s"], t["warm_s"])

    rows = [
        (f"prefixkv cache {mode}", t["cold_s"], t["warm_s"], cold_over_warm(mode, t), f"{t['warm_cached_tokens'][0]}")
        for mode, t in ttft.items()
    ]
    rows.append((ref["label"], ref["cold_s"], ref["warm_s"], ratio(ref["cold_s"], ref["warm_s"]), "-"))
    common.print_table(
        ["engine", "cold TTFT s", "warm TTFT s", "cold/warm (median per repetition)", "warm cached tokens"],
        rows,
        title=f"system prompt: {cfg['system_tokens']} + {cfg['question_tokens']} tokens, "
        f"median of {cfg['repeats']}, {cfg['dtype']}, {cfg['num_threads']} threads",
    )
    print(
        f"warm vs cold speed-up with caching ({on_mode}): {results['speedup_warm_vs_cold_on']:.1f}x "
        f"(target >= {results['target_speedup']:.0f}x); warm TTFT off/on: {results['speedup_warm_on_vs_off']:.1f}x; "
        f"cold TTFT on/off: {results['cold_overhead_on_vs_off']:.2f} (medians of per-repetition ratios)"
    )
    labels = {
        "warm_vs_cold_on": f"warm vs cold TTFT, cache {on_mode}",
        "warm_vs_cold_off": "warm vs cold TTFT, cache off",
        "warm_on_vs_off": f"warm TTFT, cache {on_mode} vs off",
        "cold_on_vs_off": f"cold TTFT, cache {on_mode} vs off",
    }
    for key, p in results.get("paired", {}).items():  # > 1: the first side faster
        print(f"  {labels[key]}: {from_ratios(p['ratios']).describe()}")


def plot(results: dict, png_path: str) -> None:
    """Four bars (cold/warm x on/off) plus the two reference bars, log scale so the warm bar stays visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    for mode, t in results["ttft"].items():
        for phase in ("cold", "warm"):
            labels.append(f"{phase}\ncache {mode}")
            values.append(t[f"{phase}_s"])
            colors.append("tab:blue" if mode != "off" else "tab:orange")
    ref = results["reference"]
    labels += ["cold\nvLLM ref", "warm\nvLLM ref"]
    values += [ref["cold_s"], ref["warm_s"]]
    colors += ["tab:gray", "tab:gray"]
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(labels, values, color=colors)
    ax.bar_label(bars, labels=[f"{v * 1000:.0f} ms" for v in values], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title(
        f"TTFT, {cfg['system_tokens']}-token system prompt + {cfg['question_tokens']}-token question "
        f"({cfg['dtype']}, {cfg['num_threads']} threads)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
