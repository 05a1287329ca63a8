"""Back the KV pool with transparent huge pages (Linux), so that reading scattered pages costs fewer TLB misses.

Attention reads a request's KV as 16-slot runs spread over the whole pool (often more than a GiB); with 4 KiB
pages nearly every run is a TLB miss. The kernel here hands out huge pages only to memory marked with
madvise(MADV_HUGEPAGE) (`transparent_hugepage=madvise`, the common default), and the mark must come before the
memory is first touched. Only the pool is marked, not every tensor: short-lived activations backed by huge pages
were slower (each fresh 2 MiB page is zeroed, and the kernel may compact memory to find one).

The pool is a fresh anonymous mapping rather than an allocator's block: the kernel hands it out zero-filled, page
by page on first touch, so the pool costs nothing at start (zeroing a GiB took 0.03-2.6 s on the 2-vCPU VMs here,
once per engine) and only the pages a workload reaches are ever faulted in (~0.1 ms a 2 MiB page, paid once).
Elsewhere (other OSes, other devices) this is a plain zero-filled tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < 2 * _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    # one huge page more than needed, so the tensor can start on a huge-page boundary and be covered whole
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    offset = -whole.data_ptr() % _HUGE_PAGE
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise(ctypes.c_void_p(whole.data_ptr() + offset), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # advisory only
    return whole[offset : offset + nbytes].view(dtype).view(shape)
