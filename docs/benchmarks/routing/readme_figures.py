"""Print README.md's tables and the figures its prose quotes, from the JSON results next to this file.

    .venv/bin/python docs/benchmarks/routing/readme_figures.py

Reads slice_{4,8}replicas*.json (the held-out slice: the default weights, queue_weight 0, decode_weight 0, no load
term, Dynamo's weights), full_{4,8}replicas.json (the whole trace) and tuning_sweep.json; runs nothing. Every
number in README.md's tables and prose (outside "On the model") is printed here.
"""

from __future__ import annotations

import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROUTERS = ("round-robin", "least-loaded", "power-of-two", "approximate", "precise", "pooled")
BLIND = ("round-robin", "least-loaded", "power-of-two")


def load(name: str) -> dict:
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def cells(sweep: dict) -> dict[tuple[float, int], dict[str, dict]]:
    """(fraction, load) -> router -> run, in the README's order (pool, then load ascending)."""
    out: dict[tuple[float, int], dict[str, dict]] = {}
    for run in sweep["runs"]:
        out.setdefault((run["fraction"], round(1 / run["time_scale"])), {})[run["router"]] = run
    return dict(sorted(out.items()))


def label(key: tuple[float, int]) -> str:
    return f"{key[0] * 100:g}%, {key[1]}x"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def tables(sweep: dict) -> None:
    grid = cells(sweep)
    bound = sweep["bounds"]["offline"]
    print("| pool per replica, load | " + " | ".join(ROUTERS) + " | offline bound |")
    print("|---" * (len(ROUTERS) + 2) + "|")
    for key, runs in grid.items():
        best = max((r for r in ROUTERS if r != "pooled"), key=lambda r: runs[r]["token_hit_rate"])
        row = [
            f"**{pct(runs[r]['token_hit_rate'])}**" if r == best else pct(runs[r]["token_hit_rate"]) for r in ROUTERS
        ]
        print(f"| {label(key)} | " + " | ".join(row) + f" | {pct(bound[str(key[0])]['offline_hit_rate'])} |")
    print()
    print("| pool per replica, load | " + " | ".join(ROUTERS) + " |")
    print("|---" * (len(ROUTERS) + 1) + "|")
    for key, runs in grid.items():
        row = []
        for r in ROUTERS:
            t = runs[r]["ttft_s"]
            row.append(f"{t['p50']:.2f} / {t['p90']:.2f} / {t['p99']:.2f}, {runs[r]['output_tok_s']:.0f}")
        print(f"| {label(key)} | " + " | ".join(row) + " |")
    print()
    print("| pool per replica, load | precise - approx | approx - RR | pooled - precise | RR p90 / precise p90 |")
    print("|---|---|---|---|---|")
    for key, runs in grid.items():
        diffs = [
            pts(runs, "precise", "approximate"),
            pts(runs, "approximate", "round-robin"),
            pts(runs, "pooled", "precise"),
        ]
        ratio = p90_ratio(runs, "round-robin", "precise")
        print(f"| {label(key)} | " + " | ".join(f"{d:+.2f}" for d in diffs) + f" | {ratio:.2f}x |")
    print()


def pts(runs: dict, a: str, b: str) -> float:
    return 100 * (runs[a]["token_hit_rate"] - runs[b]["token_hit_rate"])


def p90_ratio(runs: dict, a: str, b: str) -> float:
    return runs[a]["ttft_s"]["p90"] / runs[b]["ttft_s"]["p90"]


def span(values: list[float], fmt: str) -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def scored(point: dict) -> str:
    """A tuning_sweep.json point's objective and mean hit rate."""
    return f"{point['objective_geomean_ttft_p90_s']:.3f} s, mean hit rate {pct(point['mean_hit_rate'])}"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    slices = {n: load(f"slice_{n}replicas.json") for n in (4, 8)}
    full = {n: load(f"full_{n}replicas.json") for n in (4, 8)}
    for n in (4, 8):
        opts = slices[n]["options"]
        print(
            f"## slice, {n} replicas: start_s {opts['start_s']}, max_requests {opts['max_requests']}, "
            f"router options {opts.get('router_option')}, {slices[n]['scaling']}"
        )
        tables(slices[n])
    for n in (4, 8):
        print(f"## whole trace, {n} replicas: router options {full[n]['options'].get('router_option')}")
        tables(full[n])

    grids = {n: cells(slices[n]) for n in (4, 8)}
    heavy, queues, light = {4: 64, 8: 128}, {4: 32, 8: 64}, {4: 16, 8: 32}
    print("## figures for the prose (slices unless 'whole trace')")
    all_cells = [(n, key, runs) for n in (4, 8) for key, runs in grids[n].items()]
    all_cells += [(n, key, runs) for n in (4, 8) for key, runs in cells(full[n]).items()]
    blind = [runs[r]["token_hit_rate"] for _, _, runs in all_cells for r in BLIND]
    aware = [pts(runs, "pooled", r) for _, _, runs in all_cells for r in ("approximate", "precise")]
    print(f"cache-blind hit rate, all cells and the whole trace: {span([100 * b for b in blind], '{:.1f}')}%")
    print(f"pooled - cache-aware router, largest: {max(aware):.2f} points")
    balance = [
        1 - min(runs[r]["ttft_s"]["p90"] for r in BLIND[1:]) / runs["round-robin"]["ttft_s"]["p90"]
        for _, _, runs in all_cells
    ]
    print(f"best of least-loaded / power-of-two p90 below round-robin's: up to {100 * max(balance):.0f}% lower")
    for n in (4, 8):
        gains = [pts(r, "approximate", "round-robin") for r in grids[n].values()]
        print(f"{n} replicas: approx - RR {span(gains, '{:.1f}')}")
    ahead = [(n, k, pts(r, "precise", "approximate")) for n, k, r in all_cells]
    print(
        f"precise ahead of approximate in {sum(d > 0 for *_, d in ahead)} of {len(ahead)} cells, "
        f"by up to {max(d for *_, d in ahead):.2f} points; behind in:"
    )
    for n, k, d in ahead:
        if d <= 0:
            print(f"   {n} replicas, {label(k)}: {d:+.2f}")
    gaps = [(pts(r, "pooled", "precise"), n, label(k)) for n, k, r in all_cells]
    print(
        f"largest pooled - precise: {max(gaps)}; whole trace:",
        [f"{pts(r, 'pooled', 'precise'):.2f}" for n in (4, 8) for r in cells(full[n]).values()],
    )
    print(
        "routers above pooled:",
        [
            (n, label(k), r, pct(runs[r]["token_hit_rate"]), pct(runs["pooled"]["token_hit_rate"]))
            for n, k, runs in all_cells
            for r in ROUTERS[:-1]
            if runs[r]["token_hit_rate"] > runs["pooled"]["token_hit_rate"]
        ],
    )
    for name, loads in (("round-robin queues", queues), ("overloaded", heavy), ("light", light)):
        for n in (4, 8):
            sel = [(k, r) for k, r in grids[n].items() if k[1] == loads[n]]
            rr = [r["round-robin"]["ttft_s"]["p90"] for _, r in sel]
            print(
                f"{name}, {n} replicas at {loads[n]}x: RR p90 {span(rr, '{:.1f}')} s; RR/precise p90 "
                + ", ".join(f"{p90_ratio(r, 'round-robin', 'precise'):.2f}x" for _, r in sel)
                + "; approx/precise p90 "
                + ", ".join(f"{p90_ratio(r, 'approximate', 'precise'):.2f}" for _, r in sel)
            )
    for n in (4, 8):
        for r in cells(full[n]).values():
            print(
                f"whole trace {n} replicas: RR/precise p90 {p90_ratio(r, 'round-robin', 'precise'):.2f}x, "
                f"approx/precise p90 {p90_ratio(r, 'approximate', 'precise'):.2f}"
            )

    # the precise router with other weights on the same slices (queue_weight_0 also reruns round-robin and
    # approximate, which take no weights: they must match the main grids)
    variants = {
        "defaults (queue 0.02, decode 0.001)": {n: cells(slices[n]) for n in (4, 8)},
        "queue_weight=0 (decode 0.001)": {n: cells(load(f"slice_{n}replicas_queue_weight_0.json")) for n in (4, 8)},
        "decode_weight=0 (queue 0.02, the previous defaults)": {
            n: cells(load(f"slice_{n}replicas_precise_decode_weight_0.json")) for n in (4, 8)
        },
        "queue_weight=0, decode_weight=0 (no load term)": {
            n: cells(load(f"slice_{n}replicas_precise_no_load_terms.json")) for n in (4, 8)
        },
    }
    q0 = variants["queue_weight=0 (decode 0.001)"]
    for n in (4, 8):
        for key, runs in q0[n].items():
            for r in ("round-robin", "approximate"):
                assert runs[r]["token_hit_rate"] == grids[n][key][r]["token_hit_rate"], (n, key, r)
    print("## the tuning objective on the held-out slice: its 12 cells with the 5% and 10% pools")
    print("| router, weights | geomean TTFT p90 | mean hit rate | hit rate >= approximate's (all 18 slice cells) |")
    print("|---|---|---|---|")
    rows = [(router, grids, router) for router in ("round-robin", "approximate", "pooled")]
    rows += [(f"precise, {name}", grid, "precise") for name, grid in variants.items()]
    for name, grid, router in rows:
        runs = [r[router] for n in (4, 8) for k, r in grid[n].items() if k[0] < 0.2]
        ge = sum(
            grid[n][k][router]["token_hit_rate"] >= grids[n][k]["approximate"]["token_hit_rate"]
            for n in (4, 8)
            for k in grid[n]
        )
        print(
            f"| {name} | {geomean([r['ttft_s']['p90'] for r in runs]):.3f} s | "
            f"{pct(sum(r['token_hit_rate'] for r in runs) / len(runs))} | {'-' if router == 'approximate' else ge} |"
        )

    def objective(grid: dict, router: str = "precise") -> float:
        return geomean([r[router]["ttft_s"]["p90"] for n in (4, 8) for k, r in grid[n].items() if k[0] < 0.2])

    defaults = objective(variants["defaults (queue 0.02, decode 0.001)"])
    print(
        f"precise (defaults) below approximate: {100 * (1 - defaults / objective(grids, 'approximate')):.1f}%; "
        f"below the previous defaults (decode 0): "
        f"{100 * (1 - defaults / objective(variants['decode_weight=0 (queue 0.02, the previous defaults)'])):.1f}%; "
        f"below round-robin: {objective(grids, 'round-robin') / defaults:.2f}x"
    )
    print()
    print("## per cell, precise: hit rate / TTFT p90 with each set of weights; approximate last")
    print("| replicas, pool per replica, load | " + " | ".join(variants) + " | approximate |")
    print("|---" * (len(variants) + 2) + "|")
    for n in (4, 8):
        for key in grids[n]:
            row = [
                f"{pct(g[n][key]['precise']['token_hit_rate'])} / {g[n][key]['precise']['ttft_s']['p90']:.2f} s"
                for g in variants.values()
            ]
            a = grids[n][key]["approximate"]
            print(
                f"| {n}, {label(key)} | "
                + " | ".join(row)
                + f" | {pct(a['token_hit_rate'])} / {a['ttft_s']['p90']:.2f} s |"
            )
    print()

    dyn = load("slice_4replicas_precise_dynamo_weights.json")
    cell = grids[4][(dyn["options"]["kv_cache_fraction"], round(1 / dyn["options"]["time_scale"]))]["precise"]
    print(
        f"## Dynamo weights {dyn['options']['router_option']}, start_s {dyn['options']['start_s']}: "
        f"hit {pct(dyn['summary']['token_hit_rate'])}, p90 {dyn['summary']['ttft_s']['p90']:.2f} s; defaults "
        f"{pct(cell['token_hit_rate'])}, {cell['ttft_s']['p90']:.2f} s"
    )

    tuning = load("tuning_sweep.json")
    points = tuning["stage1_decode_weight_0"] + tuning["stage2"] + tuning["stage3"]
    points.sort(key=lambda p: p["objective_geomean_ttft_p90_s"])
    print(f"## tuning_sweep.json: chosen {tuning['chosen']}; best five by the objective:")
    for p in points[:5]:
        print(f"   queue {p['queue_weight']:g}, decode {p['decode_weight']:g}: {scored(p)}")
    print(f"   Dynamo (queue 1, decode 1): {scored(tuning['dynamo_reference'])}")
    chosen = next(p for p in points if (p["queue_weight"], p["decode_weight"]) == (0.02, 0.001))
    previous = next(p for p in points if (p["queue_weight"], p["decode_weight"]) == (0.02, 0))
    print(
        f"   chosen below the previous defaults (decode 0) on the tuning slice: "
        f"{100 * (1 - chosen['objective_geomean_ttft_p90_s'] / previous['objective_geomean_ttft_p90_s']):.1f}%"
    )
    zero = next(p for p in points if p["queue_weight"] == 0 and p["decode_weight"] == 0)
    print(f"   queue 0, decode 0: {scored(zero)}")

    walls = {
        f: [r["wall_s"] for r in load(f)["runs"]]
        for f in ("slice_4replicas.json", "slice_8replicas.json", "full_4replicas.json", "full_8replicas.json")
    }
    print("## wall s per run:", {f: span(w, "{:.0f}") + f" (sum {sum(w):.0f})" for f, w in walls.items()})


if __name__ == "__main__":
    main()
