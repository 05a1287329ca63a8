"""What `prefixkv simulate` shows: a plain table on stdout, strict JSON, and plots (matplotlib, loaded only here
and only when a plot is drawn, so the simulator itself stays light)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Fixed-width columns: readable in a terminal and in a pasted log."""
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def strict_json(value: Any) -> Any:
    """NaN and infinities as null: the files are read by other tools (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(strict_json(results), f, indent=2, default=str)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(summary: dict, ttfts: Sequence[float], queues: Sequence[float], title: str, path: str) -> None:
    """One run: the achieved hit rate beside its bounds, and the TTFT and queueing distributions (CDFs)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = {
        "achieved": summary["token_hit_rate"],
        "offline bound": summary.get("offline_bound_hit_rate"),
        "unbounded": summary.get("unbounded_hit_rate"),
    }
    names = [k for k, v in bars.items() if v is not None and not math.isnan(v)]
    left.bar(names, [bars[k] for k in names], color=["tab:blue", "tab:orange", "tab:gray"][: len(names)])
    for i, k in enumerate(names):
        left.text(i, bars[k], f"{bars[k]:.1%}", ha="center", va="bottom")
    left.set_ylabel("prompt-token hit rate")
    left.set_ylim(0, 1)
    for values, label in ((ttfts, "TTFT"), (queues, "queueing")):
        xs = sorted(values)
        if xs:
            right.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    right.set_xscale("symlog", linthresh=0.01)
    right.set_xlabel("simulated seconds")
    right.set_ylabel("fraction of requests")
    right.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: dict, path: str) -> None:
    """Hit rate vs pool size per policy and eviction (at the first time scale) with the bounds drawn in, and
    TTFT p99 vs load (1 / time scale) per policy and eviction at the largest pool (vs pool size when the grid
    has a single time scale)."""
    plt = _pyplot()
    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    first_scale = results["grid"]["time_scales"][0]
    largest = max(results["grid"]["fractions"])
    by_load = len(results["grid"]["time_scales"]) > 1
    labels = sorted({(r["policy"], r["eviction"], r.get("router", "")) for r in runs})
    several_routers = len({router for _, _, router in labels}) > 1
    for policy, eviction, router in labels:
        name = f"{policy} / {eviction}" + (f" / {router}" if several_routers else "")
        mine = [r for r in runs if (r["policy"], r["eviction"], r.get("router", "")) == (policy, eviction, router)]
        by_size = sorted((r["fraction"], r["token_hit_rate"]) for r in mine if r["time_scale"] == first_scale)
        left.plot([x for x, _ in by_size], [y for _, y in by_size], marker="o", label=name)
        if by_load:
            ttft = sorted((1 / r["time_scale"], r["ttft_s"]["p99"]) for r in mine if r["fraction"] == largest)
        else:
            ttft = sorted((r["fraction"], r["ttft_s"]["p99"]) for r in mine)
        right.plot([x for x, _ in ttft], [y for _, y in ttft], marker="o", label=name)
    bounds = sorted((float(f), b["offline_hit_rate"]) for f, b in results["bounds"]["offline"].items())
    if bounds:
        left.plot([x for x, _ in bounds], [y for _, y in bounds], "k--", label="offline bound")
    left.axhline(results["bounds"]["unbounded_hit_rate"], color="gray", linestyle=":", label="unbounded cache")
    left.set_xlabel("pool size (fraction of the trace's unique prompt tokens)")
    left.set_ylabel("prompt-token hit rate")
    left.set_title(f"time scale {first_scale}", fontsize=9)
    left.legend(fontsize=7)
    if by_load:
        right.set_xlabel("load (1 / time scale)")
        right.set_title(f"pool {largest} of unique tokens", fontsize=9)
    else:
        right.set_xlabel("pool size (fraction of the trace's unique prompt tokens)")
        right.set_title(f"time scale {first_scale}", fontsize=9)
    right.set_ylabel("TTFT p99 (simulated s)")
    right.ticklabel_format(axis="y", useOffset=False)
    right.legend(fontsize=7)
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_routers(results: dict, path: str) -> None:
    """A sweep over routers: per cell (pool size, load), the hit rate and the TTFT p90 of each router side by side
    (grouped bars), the offline bound of the cell's pool drawn over the hit rates."""
    plt = _pyplot()
    runs = results["runs"]
    routers = results["grid"]["routers"]
    cells = sorted({(r["fraction"], r["time_scale"]) for r in runs}, key=lambda c: (c[0], -c[1]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(cells) + 3), 7), sharex=True)
    width = 0.8 / len(routers)
    for k, router in enumerate(routers):
        mine = {(r["fraction"], r["time_scale"]): r for r in runs if r["router"] == router}
        xs = [i + (k - (len(routers) - 1) / 2) * width for i in range(len(cells))]
        top.bar(xs, [mine[c]["token_hit_rate"] for c in cells], width, label=router)
        bottom.bar(xs, [mine[c]["ttft_s"]["p90"] for c in cells], width, label=router)
    for i, (fraction, _) in enumerate(cells):
        bound = results["bounds"]["offline"].get(str(fraction))
        if bound:
            top.hlines(bound["offline_hit_rate"], i - 0.45, i + 0.45, colors="k", linestyles="--")
    top.set_ylabel("prompt-token hit rate (-- offline bound)")
    top.legend(fontsize=7, ncol=3, loc="lower left")
    bottom.set_ylabel("TTFT p90 (simulated s)")
    bottom.set_yscale("log")
    bottom.set_xticks(range(len(cells)))
    bottom.set_xticklabels([f"pool {f:g}\nload {1 / s:g}x" for f, s in cells], fontsize=8)
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sessions(results: dict, path: str) -> None:
    """Agent sessions: hit rate (with the offline bound of each run's order) and mean JCT (over the sessions every
    run served whole) vs pool size, per session policy."""
    plt = _pyplot()
    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy in dict.fromkeys(r.get("label", r["policy"]) for r in runs):
        mine = sorted((r for r in runs if r.get("label", r["policy"]) == policy), key=lambda r: r["fraction"])
        xs = [r["fraction"] for r in mine]
        left.plot(xs, [r["token_hit_rate"] for r in mine], marker="o", label=policy)
        # over the sessions every run served whole: a run that rejected requests would otherwise look faster
        right.plot(xs, [r.get("jct_common_s", r["jct_s"])["mean"] for r in mine], marker="o", label=policy)
    for tier in sorted({r.get("tier_fraction", 0) for r in runs}):
        bound = sorted(
            {
                (r["fraction"], r["offline_bound_hit_rate"])
                for r in runs
                if "offline_bound_hit_rate" in r and r.get("tier_fraction", 0) == tier
            }
        )
        if bound:  # the bound of each run's own order; the highest per pool size is drawn
            best = {x: max(y for x2, y in bound if x2 == x) for x, _ in bound}
            what = f"pool + tier {tier:g}" if tier else "pool"
            style = "k--" if not tier else "k-."
            left.plot(list(best), list(best.values()), style, label=f"offline bound (Belady), {what}")
    unbounded = [r["unbounded_hit_rate"] for r in runs if "unbounded_hit_rate" in r]
    if unbounded:
        left.axhline(max(unbounded), color="gray", linestyle=":", label="unbounded cache")
    for ax in (left, right):
        ax.set_xscale("log")  # fractions from a tenth to beyond the whole working set
        ax.set_xlabel("pool size (fraction of the sessions' working set, log scale)")
        ax.legend(fontsize=7)
    left.set_ylabel("prompt-token hit rate")
    common = len(results.get("common_sessions", results["drawn"]))
    right.set_ylabel(f"mean JCT of the {common} sessions every run served whole (simulated s)", fontsize=8)
    fig.suptitle(
        f"{results['trace']['path']}: {len(results['drawn'])} sessions, {results['scaling']}, "
        f"cost model {results['cost_model']['name']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
