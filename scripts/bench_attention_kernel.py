"""Time the native bf16 attention kernels on SmolLM2's shapes (9 query heads over 3 kv heads of 64) and print
GFLOPS: a causal 2048-token prefill, 1600 query rows over a shared 1024-token prefix (the shared-prefix row's
stacked chunks), and 32 decodes over 1100-token contexts; on the build's vector path (AVX512_BF16 dot products, or
float32 FMAs on a CPU without AVX-512), on AMX tiles where the CPU has them (isa 1), and, with --torch, torch's
bf16 SDPA on the same K/V gathered (what runs without the native kernels). For A/B runs of kernel changes: run it
before and after, side by side, on an idle machine, with --out, so the raw samples are kept (JSON: every round's
time, the CPU, the thread count).

    .venv/bin/python scripts/bench_attention_kernel.py [--threads 2] [--rounds 5] [--torch] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.nn.functional as F

from prefixkv.model import cpu_features, native

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def timed(fn, iterations: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="samples per case (the table shows their median)")
    parser.add_argument("--torch", action="store_true", help="also time torch's SDPA on the same gathered K/V")
    parser.add_argument("--out", default=None, help="write the raw samples as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.flash_attention()
    if kernels is None:
        raise SystemExit("the native attention kernels are not built here (need AVX-512 BF16 or AVX2 + FMA)")
    isas: dict = {native.attention_isa(): 0, **({"amx": 1} if native.amx_gemm() is not None else {})}
    if args.torch:
        isas["torch"] = "torch"
    heads, slots = KV_HEADS * GROUP, 65536
    pool = torch.randn(2, KV_HEADS, slots, HEAD_DIM).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def q(rows: int) -> torch.Tensor:
        return torch.randn(rows, heads, HEAD_DIM).to(torch.bfloat16)

    n = 2048
    q1, s1, p1 = q(n), torch.randperm(slots)[:n], torch.arange(n)
    rows, prefix = 1600, 1024
    q2, s2, p2 = q(rows), torch.randperm(slots)[:prefix], torch.full((rows,), prefix - 1)
    batch, length, page_size = 32, 1100, 16
    pages = -(-length // page_size)
    q3 = q(batch)
    table = torch.randperm(slots // page_size)[: batch * pages].view(batch, pages)
    lens = torch.full((batch,), length)
    flops_per_key = 4 * HEAD_DIM * heads  # scores and values, multiply and add
    slots3 = (table[:, :, None] * page_size + torch.arange(page_size)).flatten(1)[:, :length]

    def sdpa(q: torch.Tensor, slots: torch.Tensor, causal: bool) -> torch.Tensor:
        """torch's path: K/V gathered from the pool, query heads grouped over kv heads ([..., H, rows, d])."""
        k, v = pool[0][:, slots], pool[1][:, slots]  # [KVH, ..., L, d]
        if slots.dim() == 2:  # decodes: [B, KVH, L, d]
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)

    q1t, q2t, q3t = q1.transpose(0, 1), q2.transpose(0, 1), q3[:, :, None]
    cases = {  # name: (call for an isa, iterations, keys attended)
        "causal prefill, 2048 tokens": (
            lambda i: sdpa(q1t, s1, True) if i == "torch" else kernels.flash_attention(q1, pool, s1, p1, scale, isa=i),
            10,
            n * n / 2,
        ),
        "1600 rows over a 1024-token shared prefix": (
            lambda i: sdpa(q2t, s2, False) if i == "torch" else kernels.flash_attention(q2, pool, s2, p2, scale, isa=i),
            10,
            rows * prefix,
        ),
        "32 decodes over 1100 tokens": (
            lambda i: (
                sdpa(q3t, slots3, False)
                if i == "torch"
                else kernels.paged_flash_decode(q3, pool, table, lens, page_size, scale, isa=i)
            ),
            20,
            batch * length,
        ),
    }
    samples: dict = {name: {isa: [] for isa in isas} for name in cases}
    for r in range(args.rounds):  # the isas alternate within each round
        for name, (call, iterations, _) in cases.items():
            for isa, code in isas.items() if r % 2 == 0 else reversed(isas.items()):
                samples[name][isa].append(timed(lambda c=code, f=call: f(c), iterations))
    cpu = cpu_features.describe()
    print(f"{cpu['model']}, {args.threads} threads, median of {args.rounds} rounds")
    summary = {}
    for name, (_, _, keys) in cases.items():
        for isa in isas:
            seconds = statistics.median(samples[name][isa])
            gflops = flops_per_key * keys / seconds / 1e9
            summary[f"{name} [{isa}]"] = {"ms": seconds * 1e3, "gflops": gflops}
            print(f"{name} [{isa}]: {seconds * 1e3:.2f} ms, {gflops:.0f} GFLOPS")
    if args.out:
        with open(args.out, "w") as f:
            config = {
                "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "cpu": cpu,
                "threads": args.threads,
                "rounds": args.rounds,
            }
            json.dump({"config": config, "summary": summary, "samples_s": samples}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
