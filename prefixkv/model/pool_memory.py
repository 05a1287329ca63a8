"""The KV pool's memory: a fresh anonymous mapping (Linux CPU), so an engine's start costs nothing.

The kernel hands such a mapping out zero-filled, page by page on first touch: an engine's start no longer zeroes
the whole pool (0.03-2.6 s a GiB on the 2-vCPU VMs here, once per engine; the suite builds ~150 engines), and only
the 4 KiB pages a workload reaches are ever faulted in.

Not on transparent huge pages (an earlier version marked the pool MADV_HUGEPAGE for fewer TLB misses): on these
VMs faulting in a 2 MiB page took ~17 ms against ~1 ms for the same memory in 4 KiB pages, and decode over huge
pages was no faster (`scripts/bench_pool_pages.py`, docs/benchmarks/kv_pool_pages, AMD EPYC, bf16, medians of 2:
16 cold 2000-token prefills 16.3 s lazy, 18.5 s on huge pages, 14.6 s zeroed at start; then 16 x 64 decode steps
3.6 s in all three). One token spreads over every layer and head, so a huge page is faulted in whole by its first
tokens; the 4 KiB faults are paid once, on the pages a workload reaches.
Elsewhere (other OSes, other devices) this is a plain zero-filled tensor.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor whose memory is faulted in (and zeroed by the kernel) only where it is first written."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    return raw.view(dtype).view(shape)
