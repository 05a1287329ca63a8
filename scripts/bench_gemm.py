"""The matrix products side by side on SmolLM2's weight shapes, for the row counts the engine issues (1: one
decode; 16, 64: decode batches and warm prefills; 256, 2048: prefill chunks). bf16: oneDNN (packed weights; torch's
F.linear where oneDNN has no bf16) against prefixkv's row-invariant kernels (avx512_bf16, amx where the CPU has
it, avx2 on a CPU without AVX-512). float32 (--dtype float32): torch's F.linear (MKL) against the AVX2 build's
gemm_f32.

Paths alternate within every round (so a busy machine slows each alike) and every sample is kept; the table shows
medians over rounds, GFLOPS and each path's time relative to the first (the library's). The JSON (--out) holds the
raw samples, the CPU and the thread count, so an A/B claim can be checked later.

    .venv/bin/python scripts/bench_gemm.py [--dtype bfloat16] [--threads 2] [--rounds 5] [--rows 1,16,64,256,2048]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time

import torch

from prefixkv.model import cpu_features, matmul

SHAPES = {  # name: (out_features, in_features), SmolLM2-135M
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def time_call(fn, budget_s: float = 0.15) -> float:
    """Seconds per call: warm up, then repeat for about budget_s and take the mean."""
    fn()
    fn()
    start = time.perf_counter()
    calls = 0
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s and calls >= 3:
            return elapsed / calls


def compared_paths(dtype: torch.dtype) -> list[str]:
    """The library's path first (oneDNN, else torch), then prefixkv's kernels that run here for `dtype`."""
    available = matmul.available("cpu", dtype)
    library = "onednn" if "onednn" in available else "torch"
    return [library, *(p for p in ("avx512_bf16", "amx", "avx2") if p in available)]


def run(threads: int, rounds: int, rows: list[int], shapes: list[str], dtype: torch.dtype = torch.bfloat16) -> dict:
    torch.set_num_threads(threads)
    paths = compared_paths(dtype)
    gen = torch.Generator().manual_seed(0)
    samples: dict = {}
    for name in shapes:
        n, k = SHAPES[name]
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        packed = {p: matmul.pack(weight, p) for p in paths}
        for m in rows:
            if name == "lm_head" and m > 256:
                continue  # the engine applies the lm_head to sampled rows only
            x = torch.randn(m, k, generator=gen).to(dtype)
            key = f"{name} M={m}"
            samples[key] = {"n": n, "k": k, "m": m, **{p: [] for p in paths}}
            for r in range(rounds):
                order = paths if r % 2 == 0 else list(reversed(paths))
                for p in order:
                    call = functools.partial(matmul.linear, x, weight, packed[p], None)
                    samples[key][p].append(time_call(call))
    return {"paths": paths, "samples": samples}


def median_rows(samples: dict, paths: list[str], base: str, columns) -> list[dict]:
    """One row per shape: each path's columns(sample, path, median seconds) and its time relative to base's
    (bench_qgemm.py shares it)."""
    rows = []
    for key, s in samples.items():
        row: dict = {"shape": key}
        base_t = statistics.median(s[base]) if base in s else None
        for p in paths:
            t = statistics.median(s[p])
            row.update({f"{p}_{name}": value for name, value in columns(s, p, t).items()})
            if base_t is not None and p != base:
                row[f"{p}_time_vs_{base}"] = t / base_t
        rows.append(row)
    return rows


def add_common_args(parser: argparse.ArgumentParser, rows: str) -> None:
    """--threads, --rounds, --rows (default `rows`), --shapes and --out (bench_qgemm.py takes them too)."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default=rows, help="row counts M, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"weights, of {','.join(SHAPES)}")
    parser.add_argument("--out", default=None, help="write the raw samples and the summary as JSON here")


def summarize(result: dict) -> list[dict]:
    def columns(s: dict, p: str, t: float) -> dict:
        return {"ms": t * 1e3, "gflops": 2 * s["m"] * s["n"] * s["k"] / t / 1e9}

    return median_rows(result["samples"], result["paths"], result["paths"][0], columns)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, rows="1,16,64,256,2048")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    dtype = getattr(torch, args.dtype)
    if len(compared_paths(dtype)) < 2:
        raise SystemExit(f"prefixkv has no {args.dtype} matrix product built here")
    cpu = cpu_features.describe()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result = run(args.threads, args.rounds, rows, shapes, dtype)
    summary = summarize(result)
    base, *ours = result["paths"]
    print(f"{cpu['model']} ({', '.join(cpu['flags'])}), {args.dtype}, {args.threads} threads, median of {args.rounds}")
    header = f"{'shape':18s}" + "".join(f"{p + ' ms':>17s}{'GFLOPS':>8s}" for p in result["paths"])
    print(header + "".join(f"{p + '/' + base:>18s}" for p in ours))
    for row in summary:
        line = f"{row['shape']:18s}" + "".join(
            f"{row[p + '_ms']:17.3f}{row[p + '_gflops']:8.0f}" for p in result["paths"]
        )
        print(line + "".join(f"{row[f'{p}_time_vs_{base}']:18.2f}" for p in ours))
    if args.out:
        with open(args.out, "w") as f:
            config = {
                "date_utc": started,
                "cpu": cpu,
                "dtype": args.dtype,
                "threads": args.threads,
                "rounds": args.rounds,
            }
            json.dump({"config": config, "summary": summary, **result}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
