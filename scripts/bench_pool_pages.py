"""A/B of the KV pool's memory backing: the lazy 4 KiB mapping the runner uses against the pool marked for
transparent huge pages (madvise, the earlier backing) and against torch.zeros (zeroed at start). Each arm runs in
a fresh process (a process's first pool pays the page faults), alternating, on one bf16 engine: an engine start,
16 cold 2000-token prefills (one output token), then 16 x 64 decode steps behind them (full hits). JSON with every
round, the CPU and the thread count.

    .venv/bin/python scripts/bench_pool_pages.py [--rounds 2] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import json
import mmap
import random
import statistics
import subprocess
import sys
import time

ARMS = ("lazy_4k", "huge_pages", "zeros")


def huge_page_zeros(shape, dtype, device):
    """The earlier backing: a fresh mapping marked MADV_HUGEPAGE before first touch, 2 MiB aligned."""
    import torch

    huge = 2 << 20
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -whole.data_ptr() % huge
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise(ctypes.c_void_p(whole.data_ptr() + offset), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE
    return whole[offset : offset + nbytes].view(dtype).view(shape)


def one_arm(arm: str, threads: int) -> dict[str, float]:
    import torch

    import prefixkv.model.runner as runner
    from prefixkv.llm import LLM
    from prefixkv.sampling_params import SamplingParams

    if arm == "huge_pages":
        runner.lazily_zeroed = huge_page_zeros
    elif arm == "zeros":
        runner.lazily_zeroed = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device)
    start = time.perf_counter()
    llm = LLM(dtype="bfloat16", kv_cache_tokens=34000, num_threads=threads)
    started = time.perf_counter()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(2000)]} for _ in range(16)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefilled = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=65, ignore_eos=True), use_tqdm=False)
    decoded = time.perf_counter()
    return {"start_s": started - start, "cold_prefill_s": prefilled - started, "decode_s": decoded - prefilled}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # the child process's own arm
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_arm(args.arm, args.threads)))
        return 0
    from prefixkv.model import cpu_features

    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            command = [sys.executable, __file__, "--arm", arm, "--threads", str(args.threads)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            samples[arm].append(json.loads(out.strip().splitlines()[-1]))
            print(arm, samples[arm][-1], flush=True)
    medians = {arm: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for arm, rows in samples.items()}
    for arm, row in medians.items():
        print(f"{arm:>10}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
    if args.out:
        result = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu": cpu_features.describe(),
            "threads": args.threads,
            "medians": medians,
            "samples": samples,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
