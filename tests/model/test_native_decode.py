"""The native in-place decode kernel (prefixkv/model/csrc/paged_decode.cpp) equals plain attention.

Kernel level: random pools, scattered pages (page size 16 and 1), context lengths around page boundaries, the
AVX-512 path (head_dim 64) and the generic one (32, 128), GQA groups of 1, 3 and 7, three dtypes. Step level:
paged_attention with in-place decodes equals the gathered padded path, alone and next to cascade groups.
"""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import native
from prefixkv.model.attention import (
    InPlaceDecodes,
    PaddedDecodes,
    StepPlanner,
    paged_attention,
)
from prefixkv.model.options import KernelOptions
from tests.model.test_cascade_attention import KVH, D, _step

kernel = native.module()
needs_kernel = pytest.mark.skipif(kernel is None, reason="native kernel not built here")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def test_kernel_builds_on_this_machine():
    """Linux x86-64 with a C++ compiler (this project's machines) must get the kernel, not the fallback."""
    if platform.system() == "Linux" and platform.machine() == "x86_64" and shutil.which("c++"):
        assert kernel is not None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, kv_heads, group", [(64, 3, 3), (64, 2, 7), (32, 4, 1), (128, 1, 4)])
@pytest.mark.parametrize("page_size", [16, 1])
def test_kernel_equals_reference(dtype, head_dim, kv_heads, group, page_size):
    gen = torch.Generator().manual_seed(head_dim * 7 + group + page_size)
    slots = 4096
    pool = torch.randn(2, kv_heads, slots, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 300, 33])
    max_pages = -(-int(lens.max()) // page_size)
    table = torch.stack([torch.randperm(slots // page_size, generator=gen)[:max_pages] for _ in lens])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = kernel.paged_decode_attention(q, pool, table, lens, page_size, scale)
    same, lse = kernel.paged_decode_attention_lse(q, pool, table, lens, page_size, scale)
    assert torch.equal(same, out)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        s = table[b][pos // page_size] * page_size + pos % page_size
        qb = q[b].float().view(kv_heads, group, head_dim)
        expected = F.scaled_dot_product_attention(qb, pool[0][:, s].float(), pool[1][:, s].float(), scale=scale)
        torch.testing.assert_close(
            out[b].float(), expected.reshape(kv_heads * group, head_dim), atol=TOL[dtype], rtol=0
        )
        scores = torch.einsum("kgd,kld->kgl", qb, pool[0][:, s].float()) * scale
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1).reshape(-1), atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_decodes_equal_gathered(page_size, cascade, dtype):
    """A whole mixed step (decodes sharing pages or not, prefill chunks): in-place decodes == padded groups."""
    counts, starts, tables, slots = _step(page_size)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(2, KVH, slots, D, generator=gen).to(dtype)
    q = torch.randn(sum(counts), KVH * 3, D, generator=gen).to(dtype)
    kv = torch.randn(sum(counts), 2, KVH, D, generator=gen).to(dtype)
    outs = []
    for in_place in (False, True):
        options = KernelOptions.choose(
            "cpu", dtype, cascade_decodes=cascade, split_prefill=False, in_place_decodes=in_place
        )
        meta = StepPlanner(options, page_size, dtype, 2 * KVH * D).plan(counts, starts, tables)
        assert bool(meta.groups_of(InPlaceDecodes)) == in_place and (not in_place or not meta.groups_of(PaddedDecodes))
        outs.append(paged_attention(q.clone(), kv.clone(), pool.clone(), meta, D**-0.5))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=TOL[dtype], rtol=0)
