"""The weight-only quantized matrix product (csrc/gemm_q.cpp: q8_0, q4_1, q4_0 GGUF blocks, bf16 activations)
against the bf16 row-invariant product (csrc/gemm/gemm.cpp) on SmolLM2's weight shapes, with the weights cold.

Cold: every call reads another copy of the packed weights, cycling through enough copies to exceed the last-level
cache several times over (--cold-mb in all per path), so each call streams its weights from memory, as a decode
step does (a model's weights do not fit in L3). GB/s is the packed weight bytes one call reads (scales included;
x and y are a few KB) over its time. Paths alternate within every round (a busy machine slows each alike), every
sample is kept in the JSON (--out) with the CPU and the thread count; the table shows medians over rounds.

    .venv/bin/python scripts/bench_qgemm.py [--threads 2] [--rounds 5] [--rows 1,4,16,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import time
from collections.abc import Callable

import torch
from bench_gemm import SHAPES, add_common_args, median_rows
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from prefixkv.model import cpu_features, native

FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1, "q4_0": GGMLQuantizationType.Q4_0}


def time_cycle(calls: list[Callable[[], object]], budget_s: float) -> float:
    """Seconds per call over at least one pass through `calls` (each on other weights) and about budget_s."""
    calls[-1]()
    calls[-2 % len(calls)]()
    start = time.perf_counter()
    done = 0
    while True:
        calls[done % len(calls)]()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s and done >= len(calls):
            return elapsed / done


def packed_weights(mod, weight: torch.Tensor, path: str) -> torch.Tensor:
    if path == "bf16":
        return mod.gemm_pack(weight.to(torch.bfloat16))
    blocks = quantize(weight.numpy(), FORMATS[path])
    return mod.qgemm_pack(torch.from_numpy(blocks), weight.shape[1], path)


def run(mod, paths: list[str], rows: list[int], shapes: list[str], rounds: int, cold_bytes: int, budget_s: float):
    gen = torch.Generator().manual_seed(0)
    samples: dict = {}
    for name in shapes:
        n, k = SHAPES[name]
        weight = torch.randn(n, k, generator=gen) * k**-0.5
        copies: dict[str, list[torch.Tensor]] = {}
        nbytes: dict[str, int] = {}
        for p in paths:
            packed = packed_weights(mod, weight, p)
            nbytes[p] = packed.numel() * packed.element_size()
            copies[p] = [packed] + [packed.clone() for _ in range(max(1, -(-cold_bytes // nbytes[p])) - 1)]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            key = f"{name} M={m}"
            entry: dict = {"n": n, "k": k, "m": m, "bytes": nbytes, "copies": {p: len(copies[p]) for p in paths}}
            entry.update({p: [] for p in paths})
            for r in range(rounds):
                for p in paths if r % 2 == 0 else list(reversed(paths)):
                    calls: list[Callable[[], object]] = [
                        functools.partial(mod.gemm, x, w, n)
                        if p == "bf16"
                        else functools.partial(mod.qgemm, x, w, n, p)
                        for w in copies[p]
                    ]
                    entry[p].append(time_cycle(calls, budget_s))
            samples[key] = entry
        del copies
    return samples


def summarize(samples: dict, paths: list[str]) -> list[dict]:
    def columns(s: dict, p: str, t: float) -> dict:
        return {"us": t * 1e6, "gbs": s["bytes"][p] / t / 1e9}

    return median_rows(samples, paths, "bf16", columns)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, rows="1,4,16,64")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {','.join(FORMATS)}")
    parser.add_argument("--cold-mb", type=int, default=128, help="bytes of weight copies per path (> the L3)")
    parser.add_argument("--budget-s", type=float, default=0.1, help="seconds per path, shape and round")
    args = parser.parse_args()
    mod = native.module()
    if mod is None or not mod.has_qgemm():
        raise SystemExit("prefixkv's quantized matrix product is not built here (needs AVX-512 BF16)")
    torch.set_num_threads(args.threads)
    paths = [f for f in args.formats.split(",") if f] + ["bf16"]
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    cpu = cpu_features.describe()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    samples = run(mod, paths, rows, shapes, args.rounds, args.cold_mb << 20, args.budget_s)
    summary = summarize(samples, paths)
    print(f"{cpu['model']} ({', '.join(cpu['flags'])}), {args.threads} threads, cold weights, median of {args.rounds}")
    print(f"{'shape':16s}" + "".join(f"{p + ' us':>12s}{'GB/s':>7s}{'/bf16':>7s}" for p in paths))
    for row in summary:
        line = f"{row['shape']:16s}"
        for p in paths:
            ratio = f"{row[p + '_time_vs_bf16']:7.2f}" if p != "bf16" else f"{'':7s}"
            line += f"{row[p + '_us']:12.1f}{row[p + '_gbs']:7.1f}{ratio}"
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            config = {
                "date_utc": started,
                "cpu": cpu,
                "threads": args.threads,
                "rounds": args.rounds,
                "cold_bytes_per_path": args.cold_mb << 20,
                "budget_s": args.budget_s,
                "gbs": "packed weight bytes per call / median seconds per call",
            }
            json.dump({"config": config, "paths": paths, "summary": summary, "samples": samples}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
