"""Back the KV pool with transparent huge pages (Linux), so that reading scattered pages costs fewer TLB misses.

Attention reads a request's KV as 16-slot runs spread over the whole pool (often more than a GiB); with 4 KiB
pages nearly every run is a TLB miss. The kernel here hands out huge pages only to memory marked with
madvise(MADV_HUGEPAGE) (`transparent_hugepage=madvise`, the common default), and the mark must come before the
memory is first touched. Only the pool is marked, not every tensor: short-lived activations backed by huge pages
were slower (each fresh 2 MiB page is zeroed, and the kernel may compact memory to find one). Elsewhere
(other OSes, no THP) this is a plain zero-filled tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    if device.type == "cpu" and sys.platform.startswith("linux") and nbytes >= 2 * _HUGE_PAGE:
        start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # madvise needs page-aligned ranges
        end = (tensor.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)  # advisory only
        except (OSError, AttributeError):
            pass
    return tensor.zero_()
