"""Prints the README's tables from the JSON files beside it (python readme_table.py), so every figure there is
read off a run, never typed in."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def runs(name: str) -> list[dict]:
    data = json.loads((HERE / f"{name}.json").read_text())
    return data["runs"] if "runs" in data else [data["summary"]]


def row(replicas: int, label: str, s: dict, pooled: dict) -> str:
    gap = (s["hit_tokens"] - pooled["hit_tokens"]) / s["prompt_tokens"] * 100
    ttft = f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p90']:.2f}"
    loads = " / ".join(f"{s[k]:.3f}" for k in ("routed_max_over_mean", "busy_max_over_mean", "in_flight_max_over_mean"))
    store = f"{s['shared_tier_hit_tokens'] / s['prompt_tokens']:.2%}" if "shared_tier_hit_tokens" in s else "-"
    cells = [str(replicas), label, f"{s['token_hit_rate']:.2%}", f"{gap:+.3f}", ttft, loads, store]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    print("| replicas | policy | hit rate | vs pooled (points) | TTFT p50 / p90 (s) | load max/mean: routed / busy / in flight | from the store |")
    print("|---|---|---|---|---|---|---|")
    for n in (4, 16):
        alone, shared = runs(f"replicas{n}"), runs(f"replicas{n}_shared_tier")
        pooled = next(r for r in alone if r["router"] == "pooled")
        for router in ("round-robin", "approximate", "precise"):
            print(row(n, router, next(r for r in alone if r["router"] == router), pooled))
            print(row(n, f"{router} + shared tier", next(r for r in shared if r["router"] == router), pooled))
        (no_credit,) = runs(f"replicas{n}_shared_tier_precise_no_credit")
        print(row(n, "precise + shared tier, no store credit", no_credit, pooled))
        print(row(n, "pooled", pooled, pooled))
    print()
    print("| replicas | policy | hit tokens | pooled's | difference | missed `routed` |")
    print("|---|---|---|---|---|---|")
    for n in (4, 16):
        pooled = next(r for r in runs(f"replicas{n}") if r["router"] == "pooled")
        for r in runs(f"replicas{n}_shared_tier"):
            diff = r["hit_tokens"] - pooled["hit_tokens"]
            routed = r["missed_tokens_by_cause"]["routed"]
            print(f"| {n} | {r['router']} + shared tier | {r['hit_tokens']:,} | {pooled['hit_tokens']:,} | {diff:+,} | {routed:,} |")


if __name__ == "__main__":
    main()
