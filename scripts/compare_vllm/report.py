"""Medians over rounds, the prefixkv/vLLM ratios, the distance to the machine's limit, the printed table and the
plot. Plain Python but for the plot.

A ratio above 1 always means prefixkv is ahead: prefixkv/vLLM for rates (tokens per second), vLLM/prefixkv for
times. It is taken per round (both engines' parts of a round run minutes apart, rounds hours) and the row's figure
is the median of those per-round ratios (prefixkv.bench.paired), never the ratio of the two medians; every round's
ratio is listed, and what the rounds show: "every round ahead" only where each round is, "a tie within the noise"
where the sign test cannot tell the split from chance. vLLM runs in more than one configuration where a fair peer
needs it (compare_vllm.__main__: float32 on a CPU without bf16 instructions, a reserved core for its API server on
the served rows); per row the vLLM configuration with the better median is kept (named in the table), and
prefixkv is paired round by round against that one. Each row's bound (compare_vllm.limits: the least time, or
the highest rate, this machine's measured memory bandwidth and torch's best GEMM rate allow) is shown in the row's
unit, and each engine's median as "x bound": its time over the bound's (for rates, the bound's rate over its
rate), 1 being at the limit; beside it the bound at the CPU's theoretical peak.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from compare_vllm.limits import times_bound
from compare_vllm.workloads import Sizes
from prefixkv.bench.paired import from_ratios, paired

ENGINES = ("vllm", "prefixkv")
# vLLM configurations beside the plain one (the orchestrator's names): what each changes
VLLM_VARIANTS = {
    "vllm": "bf16",
    "vllm_fp32": "fp32",
    "vllm_reserved": "bf16, 1 core reserved for the API server",
    "vllm_fp32_reserved": "fp32, 1 core reserved for the API server",
}


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    group: str  # "offline" or "serve": which part of a round measures it


def rows_for(sizes: Sizes) -> list[Row]:
    s = sizes
    ttft = f"{s.system_tokens} + {s.question_tokens} tokens, 1 out"
    shared = f"{s.num_prompts} x ({s.shared_prefix_tokens} shared + {s.shared_suffix_tokens}), {s.output_tokens} out"
    zero = f"{s.num_prompts} x {s.zero_hit_tokens} unrelated, {s.output_tokens} out"
    n_repeated = s.num_prompts // s.repeated_prefixes * s.repeated_prefixes
    prefixes = (
        f"{s.repeated_prefixes} prefixes x ({s.repeated_prefix_tokens} + {s.repeated_suffix_tokens}), "
        f"{n_repeated} prompts, {s.output_tokens} out"
    )
    return [
        Row("cold_ttft_s", f"cold TTFT ({ttft})", "s", False, "offline"),
        Row(
            "warm_ttft_s",
            f"warm TTFT (same system prompt, new question; median of {s.warm_repeats})",
            "s",
            False,
            "offline",
        ),
        Row("shared_prefix_tok_s", f"shared prefix {shared}", "out tok/s", True, "offline"),
        Row("zero_hit_tok_s", f"zero hit {zero}", "out tok/s", True, "offline"),
        Row("serve_shared_tok_s", f"serve, shared prefix {shared}", "out tok/s", True, "serve"),
        Row("serve_shared_ttft_ms", "serve, shared prefix: median TTFT", "ms", False, "serve"),
        Row("serve_zero_hit_tok_s", f"serve, zero hit {zero}", "out tok/s", True, "serve"),
        Row("serve_zero_hit_ttft_ms", "serve, zero hit: median TTFT", "ms", False, "serve"),
        Row("serve_prefixes_tok_s", f"serve, {prefixes}", "out tok/s", True, "serve"),
        Row("serve_prefixes_ttft_ms", f"serve, {s.repeated_prefixes} prefixes: median TTFT", "ms", False, "serve"),
    ]


def ratio(row: Row, vllm: float, prefixkv: float) -> float:
    """> 1 when prefixkv is ahead; nan when either side has no positive finite value."""
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (vllm, prefixkv)):
        return math.nan
    return prefixkv / vllm if row.higher_is_better else vllm / prefixkv


def median_of(values: Sequence[float]) -> float:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _value(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


def _better(row: Row, a: float, b: float) -> bool:
    """a is a better median than b (nan is never better)."""
    if not math.isfinite(a):
        return False
    return not math.isfinite(b) or (a > b if row.higher_is_better else a < b)


def summarize(
    rows: Sequence[Row], per_round: dict[str, list[dict[str, float]]], bounds: dict[str, dict] | None = None
) -> list[dict]:
    """per_round[engine][k][row.key]: one value per engine, round and row (engine: "prefixkv", "vllm" or a vLLM
    configuration of VLLM_VARIANTS); a round without the row counts as missing. Rows no round measured are left
    out. Per row the vLLM configuration with the better median is vLLM's side ("vllm" in samples and median;
    which one in vllm_variant); the ratio is the median of the per-round ratios against it.
    bounds[row.key] (compare_vllm.limits.row_bounds): the row's bound, in its unit, and how it was reached."""
    rounds = max((len(v) for v in per_round.values()), default=0)
    variants = [e for e in per_round if e != "prefixkv"]
    out = []
    for row in rows:
        aligned = {  # one value per round (nan where that round has none), so rounds stay paired
            e: [_value(r.get(row.key)) for r in per_round[e]] + [math.nan] * (rounds - len(per_round[e]))
            for e in per_round
        }
        present = {e: [v for v in aligned[e] if math.isfinite(v)] for e in aligned}
        if not any(present.values()):
            continue
        medians = {e: median_of(present[e]) for e in aligned}
        kept = "vllm" if "vllm" in aligned else (variants[0] if variants else "vllm")
        for e in variants:
            if _better(row, medians[e], medians.get(kept, math.nan)):
                kept = e
        vllm_rounds = aligned.get(kept, [math.nan] * rounds)
        prefixkv_rounds = aligned.get("prefixkv", [math.nan] * rounds)
        pair = paired(prefixkv_rounds, vllm_rounds, row.higher_is_better)
        samples = {"vllm": present.get(kept, []), "prefixkv": present.get("prefixkv", [])}
        med = {e: median_of(samples[e]) for e in ENGINES}
        bound = (bounds or {}).get(row.key)
        bound_value = bound["bound"] if bound else math.nan
        out.append(
            {
                "key": row.key,
                "label": row.label,
                "unit": row.unit,
                "higher_is_better": row.higher_is_better,
                "samples": samples,
                "median": med,
                "ratio": pair.median,  # the median of the per-round ratios
                "per_round_ratio": list(pair.ratios),
                "paired": pair.as_dict(),
                "verdict": pair.verdict,
                "vllm_variant": kept,
                "vllm_variant_medians": {e: medians[e] for e in variants if present[e]},
                "bound": bound_value,
                "peak_bound": bound.get("peak_bound", math.nan) if bound else math.nan,
                "times_bound": {e: times_bound(row.higher_is_better, med[e], bound_value) for e in ENGINES},
                "bound_detail": bound,
            }
        )
    return out


def _number(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _times(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v:.2f}x"


def format_table(summary: Sequence[dict]) -> str:
    """A Markdown table (it prints readably and pastes into the README as it is)."""
    lines = [
        "| row | unit | vLLM CPU (its better configuration) | prefixkv | prefixkv vs vLLM: median of per-round "
        "ratios (> 1: prefixkv ahead) | per round | what the rounds show | bound (measured limits) | vLLM / bound "
        "| prefixkv / bound (time; 1 = at the limit) | bound at the CPU's peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        rounds = ", ".join(_number(r) for r in s["per_round_ratio"])
        verdict = s.get("verdict") or paired_of(s).verdict
        over = s.get("times_bound", {})
        variant = s.get("vllm_variant", "vllm")
        vllm = _number(s["median"]["vllm"]) + ("" if variant == "vllm" else f" ({VLLM_VARIANTS.get(variant, variant)})")
        lines.append(
            f"| {s['label']} | {s['unit']} | {vllm} | {_number(s['median']['prefixkv'])} "
            f"| {_times(s['ratio'])} | {rounds} | {verdict} | {_number(s.get('bound', math.nan))} "
            f"| {_times(over.get('vllm', math.nan))} | {_times(over.get('prefixkv', math.nan))} "
            f"| {_number(s.get('peak_bound', math.nan))} |"
        )
    return "\n".join(lines)


def paired_of(s: dict):
    """A summary row's paired comparison from its per-round ratios (a stored summary's too)."""
    return from_ratios(s["per_round_ratio"])


def plot(summary: Sequence[dict], png_path: str, title: str) -> None:
    """One bar per row: the ratio (log scale, 1.0 marked), each bar labelled with both engines' medians."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in summary if math.isfinite(s["ratio"])]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(shown) + 1.8))
    labels = [s["label"] for s in shown][::-1]
    values = [s["ratio"] for s in shown][::-1]
    colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
    bars = ax.barh(labels, values, color=colors)
    notes = [
        f"{v:.2f}x  (vLLM {_number(s['median']['vllm'])}, prefixkv {_number(s['median']['prefixkv'])} {s['unit']})"
        for v, s in zip(values, shown[::-1])
    ]
    ax.bar_label(bars, labels=notes, fontsize=8, padding=3)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    lo, hi = min([0.5, *[v / 1.5 for v in values]]), max([2.0, *[v * 4 for v in values]])
    ax.set_xlim(lo, hi)
    ax.set_xticks([t for t in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16) if lo <= t <= hi])
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("prefixkv vs vLLM (> 1: prefixkv ahead; median of the per-round ratios, log scale)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
