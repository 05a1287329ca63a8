"""The CPU fast paths give the same numbers as the plain ones.

- Packed bf16 linear layers (oneDNN blocked weights) are bit-identical to F.linear.
- A prefill chunk whose context pages are back to back reads a view of the pool; scattered pages are gathered.
  Both give the same attention output, in one masked call and split into cached part + own part (merged).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import packed_linear
from prefixkv.model.attention import StepPlanner, paged_attention
from prefixkv.model.options import KernelOptions

KVH, GROUP, D = 3, 3, 64


@pytest.mark.skipif(
    not packed_linear.can_pack(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN bf16 matmul not supported on this CPU",
)
@pytest.mark.parametrize("rows", [1, 50, 300])
def test_packed_linear_is_bit_identical(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(3072, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(3072, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 2 * 576, generator=gen).to(torch.bfloat16)[:, :576]  # a strided view, as from a split
    packed = packed_linear.pack(weight)
    assert torch.equal(packed_linear.packed_linear(x, packed, None), F.linear(x, weight))
    assert torch.equal(packed_linear.packed_linear(x, packed, bias), F.linear(x, weight, bias))


def _attend(page_table, start, n, dtype, pool, q, kv, options):
    meta = StepPlanner(options, 16, dtype, 2 * KVH * D).plan([n], [start], [page_table])
    out = paged_attention(q.clone(), kv.clone(), pool, meta, D**-0.5)
    return meta, out


@pytest.mark.parametrize("split", [False, True, "without the flash kernel"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_back_to_back_pages_read_a_view(dtype, atol, split):
    """A chunk of 40 tokens after 200 cached ones: contiguous pages (a view) == scattered pages (a gather), and
    both equal plain attention over the whole context, in one masked call or split in two merged calls (with the
    CPU flash kernel's log-sum-exp, or the one-call fallback used where that kernel is unavailable)."""
    options = KernelOptions(split_prefill=bool(split), flash_lse=split != "without the flash kernel")
    split = options.split_prefill
    gen = torch.Generator().manual_seed(0)
    start, n = 200, 40
    pages = -(-(start + n) // 16)
    base = torch.randn(2, KVH, 64 * 16, D, generator=gen).to(dtype)
    q = torch.randn(n, KVH * GROUP, D, generator=gen).to(dtype)
    kv = torch.randn(n, 2, KVH, D, generator=gen).to(dtype)
    contiguous = list(range(3, 3 + pages))
    scattered = torch.randperm(64, generator=gen)[:pages].tolist()
    pool_a, pool_b = base.clone(), base.clone()  # the same context K/V in both layouts
    for pa, pb in zip(contiguous, scattered):
        pool_b[:, :, pb * 16 : (pb + 1) * 16] = pool_a[:, :, pa * 16 : (pa + 1) * 16]
    meta_a, out_a = _attend(contiguous, start, n, dtype, pool_a, q, kv, options)
    meta_b, out_b = _attend(scattered, start, n, dtype, pool_b, q, kv, options)
    (chunk_a,), (chunk_b,) = meta_a.groups, meta_b.groups
    context_a, context_b = chunk_a.context, chunk_b.context
    assert context_a.length == context_b.length == (start if split else start + n)
    assert context_a.first_slot == 3 * 16 and context_a.slots is None
    assert context_b.first_slot is None and len(context_b.slots) == context_b.length
    assert torch.equal(out_a, out_b)

    # reference: plain attention of the chunk over positions [0, start + n) in float32
    k_all = torch.cat((pool_a[0, :, 48 : 48 + start], kv[:, 0].transpose(0, 1)), dim=1).float()
    v_all = torch.cat((pool_a[1, :, 48 : 48 + start], kv[:, 1].transpose(0, 1)), dim=1).float()
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k_all, v_all, attn_mask=mask, scale=D**-0.5, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out_a.float(), expected, atol=atol, rtol=0)
