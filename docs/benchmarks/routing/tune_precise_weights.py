"""Tune the precise router's weights on one slice of the Mooncake trace; the held-out slice is never run here.

    .venv/bin/python docs/benchmarks/routing/tune_precise_weights.py --trace PATH [--jobs 2]

Every run is `prefixkv simulate sweep --routers precise --router-option queue_weight=Q --router-option
decode_weight=D` on the TUNING slice (the trace's first 3,000 requests, trace seconds 0-987), with the setup of
README.md, over the tuning cells: 4 replicas at 16x / 32x / 64x load and 8 replicas at 32x / 64x / 128x, each with
the 5% and 10% pools (12 cells). Stage 1 sweeps queue_weight with decode_weight 0; stage 2 sweeps decode_weight at
stage 1's best queue_weight; stage 3 tries queue_weight halfway (geometrically) between stage 1's best and its two
neighbours, at the best decode_weight so far; Dynamo's weights (decode 1, queue 1) run once as a reference.

The objective was fixed before any run: the geometric mean over the 12 cells of the precise router's TTFT p90
(lower is better); among weights within 1% of the best, the higher mean hit rate wins. The script writes
tuning_sweep.json (every run's summary, per weight pair, and the choice) next to itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIXKV = [sys.executable, "-m", "prefixkv"]  # the prefixkv importable from the working directory
SETUP = [
    "--tokens-per-block", "64", "--cost-model", "llama3-8b-h100", "--max-num-batched-tokens", "8192",
    "--max-num-seqs", "128", "--cache", "radix", "--page-size", "16", "--prefix-caching-hash-algo", "xxhash",
]  # fmt: skip
TUNING_SLICE = ["--max-requests", "3000"]  # trace seconds 0-987
HELD_OUT_SLICE = ["--start-s", "1800", "--max-requests", "3000"]  # trace seconds 1800-2637: README.md runs it
FRACTIONS = "0.05,0.1"
TIME_SCALES = {4: "0.015625,0.03125,0.0625", 8: "0.0078125,0.015625,0.03125"}  # 64x..16x and 128x..32x load
QUEUE_WEIGHTS = (0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)
DECODE_WEIGHTS = (0.001, 0.003, 0.01, 0.03, 0.1)
DYNAMO = (1, 1)  # (queue_weight, decode_weight)
TIE = 0.01  # weights within 1% of the best objective are told apart by hit rate


def sweep(trace: str, replicas: int, queue_weight: float, decode_weight: float) -> list[dict]:
    """The precise router over one replica count's tuning cells with these weights: the runs' summaries."""
    with tempfile.TemporaryDirectory() as out:
        command = [*PREFIXKV, "simulate", "sweep", "--trace", trace, *SETUP, *TUNING_SLICE, "--fractions", FRACTIONS]
        command += ["--replicas", str(replicas), "--time-scales", TIME_SCALES[replicas], "--routers", "precise"]
        for option in (f"queue_weight={queue_weight}", f"decode_weight={decode_weight}"):
            command += ["--router-option", option]
        command += ["--no-bounds", "--no-plot", "--quiet", "--output-dir", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "sweep.json")) as f:
            return json.load(f)["runs"]


def evaluate(trace: str, queue_weight: float, decode_weight: float, pool: ThreadPoolExecutor) -> dict:
    t0 = time.perf_counter()
    futures = [pool.submit(sweep, trace, n, queue_weight, decode_weight) for n in TIME_SCALES]
    runs = [run for future in futures for run in future.result()]
    p90s = [run["ttft_s"]["p90"] for run in runs]
    point = {
        "queue_weight": queue_weight,
        "decode_weight": decode_weight,
        "objective_geomean_ttft_p90_s": math.exp(sum(math.log(p) for p in p90s) / len(p90s)),
        "mean_hit_rate": sum(run["token_hit_rate"] for run in runs) / len(runs),
        "cells": [
            {
                "replicas": run["replicas"],
                "fraction": run["fraction"],
                "load": round(1 / run["time_scale"]),
                "hit_rate": run["token_hit_rate"],
                "ttft_p50_s": run["ttft_s"]["p50"],
                "ttft_p90_s": run["ttft_s"]["p90"],
                "ttft_p99_s": run["ttft_s"]["p99"],
                "output_tok_s": run["output_tok_s"],
            }
            for run in runs
        ],
        "wall_s": time.perf_counter() - t0,
    }
    print(
        f"queue_weight {queue_weight:<6g} decode_weight {decode_weight:<6g} geomean TTFT p90 "
        f"{point['objective_geomean_ttft_p90_s']:.4f} s, mean hit rate {point['mean_hit_rate']:.4f} "
        f"({point['wall_s']:.0f} s)",
        flush=True,
    )
    return point


def between(values: tuple[float, ...], chosen: float) -> list[float]:
    """Halfway (geometrically; half of it next to 0) between `chosen` and each of its neighbours in `values`."""
    i = values.index(chosen)
    neighbours = [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
    return [float(f"{math.sqrt(chosen * n):.2g}") if n and chosen else max(chosen, n) / 2 for n in neighbours]


def best(points: list[dict]) -> dict:
    low = min(p["objective_geomean_ttft_p90_s"] for p in points)
    near = [p for p in points if p["objective_geomean_ttft_p90_s"] <= low * (1 + TIE)]
    return max(near, key=lambda p: p["mean_hit_rate"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--trace", required=True, help="the whole Mooncake conversation trace (not in this repository: docs/traces.md)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once (one per replica count)")
    parser.add_argument("--output", default=os.path.join(HERE, "tuning_sweep.json"))
    args = parser.parse_args()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        stage1 = [evaluate(args.trace, q, 0, pool) for q in QUEUE_WEIGHTS]
        q = best(stage1)["queue_weight"]
        stage2 = [evaluate(args.trace, q, d, pool) for d in DECODE_WEIGHTS]
        d = best(stage1 + stage2)["decode_weight"]
        stage3 = [evaluate(args.trace, q3, d, pool) for q3 in between(QUEUE_WEIGHTS, q)]
        dynamo = evaluate(args.trace, *DYNAMO, pool)
    chosen = best(stage1 + stage2 + stage3)
    print(f"chosen: queue_weight {chosen['queue_weight']:g}, decode_weight {chosen['decode_weight']:g}")
    results = {
        "about": __doc__,
        "trace": args.trace,
        "tuning_slice": {"args": TUNING_SLICE, "start_s": 0, "max_requests": 3000, "trace_seconds": "0-987"},
        "held_out_slice": {"args": HELD_OUT_SLICE, "start_s": 1800, "max_requests": 3000, "trace_seconds": "1800-2637"},
        "setup": SETUP,
        "fractions": FRACTIONS,
        "time_scales": TIME_SCALES,
        "objective": "geometric mean of the precise router's TTFT p90 over the tuning cells; ties (1%) by hit rate",
        "stage1_decode_weight_0": stage1,
        "stage2_at_queue_weight": q,
        "stage2": stage2,
        "stage3_at_decode_weight": d,
        "stage3": stage3,
        "dynamo_reference": dynamo,
        "chosen": {"queue_weight": chosen["queue_weight"], "decode_weight": chosen["decode_weight"]},
        "wall_s": time.perf_counter() - t0,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
