"""Time the native bf16 attention kernels on SmolLM2's shapes (9 query heads over 3 kv heads of 64) and print
GFLOPS: a causal 2048-token prefill, 1600 query rows over a shared 1024-token prefix (the shared-prefix row's
stacked chunks), and 32 decodes over 1100-token contexts. For A/B runs of kernel changes: run it before and after,
side by side, on an idle machine.

    .venv/bin/python scripts/bench_attention_kernel.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from prefixkv.model import native

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.flash_attention()
    if kernels is None:
        raise SystemExit("the native attention kernel is not built here (needs AVX-512 BF16)")
    heads, slots = KV_HEADS * GROUP, 65536
    pool = torch.randn(2, KV_HEADS, slots, HEAD_DIM).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def q(rows: int) -> torch.Tensor:
        return torch.randn(rows, heads, HEAD_DIM).to(torch.bfloat16)

    n = 2048
    q1, s1, p1 = q(n), torch.randperm(slots)[:n], torch.arange(n)
    causal = timed(lambda: kernels.flash_attention(q1, pool, s1, p1, scale), 10)
    rows, prefix = 1600, 1024
    q2, s2, p2 = q(rows), torch.randperm(slots)[:prefix], torch.full((rows,), prefix - 1)
    shared = timed(lambda: kernels.flash_attention(q2, pool, s2, p2, scale), 10)
    batch, length, page_size = 32, 1100, 16
    pages = -(-length // page_size)
    q3 = q(batch)
    table = torch.randperm(slots // page_size)[: batch * pages].view(batch, pages)
    lens = torch.full((batch,), length)
    decode = timed(lambda: kernels.paged_flash_decode(q3, pool, table, lens, page_size, scale), 20)
    flops_per_key = 4 * HEAD_DIM * heads  # scores and values, multiply and add
    for name, seconds, keys in (
        ("causal prefill, 2048 tokens", causal, n * n / 2),
        ("1600 rows over a 1024-token shared prefix", shared, rows * prefix),
        ("32 decodes over 1100 tokens", decode, batch * length),
    ):
        gflops = flops_per_key * keys / seconds / 1e9
        print(f"{name}: {seconds * 1e3:.2f} ms, {gflops:.0f} GFLOPS ({args.threads} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
