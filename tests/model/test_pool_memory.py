"""The KV pool's memory (model/pool_memory.py): zeros as torch.zeros gives them, but faulted in only where written,
so an engine's start costs no memory the workload does not reach."""

from __future__ import annotations

import sys

import pytest
import torch

from prefixkv.model.pool_memory import lazily_zeroed


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_reads_as_zeros_and_takes_writes(dtype):
    pool = lazily_zeroed((2, 2, 3, 4096, 64), dtype, torch.device("cpu"))
    assert pool.shape == (2, 2, 3, 4096, 64) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[1, 0, 2, 17] = 1.5
    assert pool.sum().item() == 1.5 * 64 and pool[1, 0, 2, 17, 0].item() == 1.5
    small = lazily_zeroed((3, 5), dtype, torch.device("cpu"))  # under a page: a plain tensor
    assert small.shape == (3, 5) and not small.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazy mapping is Linux's")
def test_only_the_pages_written_are_resident():
    before = _resident_bytes()
    pool = lazily_zeroed((256 << 20,), torch.uint8, torch.device("cpu"))  # 256 MiB
    assert _resident_bytes() - before < (16 << 20)
    pool[:: 1 << 20] = 1  # one byte in each MiB: 256 pages of 4 KiB
    assert _resident_bytes() - before < (32 << 20)
    assert int(pool[:: 1 << 20].sum()) == 256 and not pool[1 : 1 << 20].any()
