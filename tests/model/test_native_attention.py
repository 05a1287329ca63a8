"""The native bf16 attention kernel (prefixkv.model.native.flash_attention) and the groups built on it.

Kernel level: random pools with scattered slots, against a float32 reference computed from the same bf16 inputs:
fresh causal chunks, chunks after cached context, single rows, rows that see a whole prefix, lengths that are not
multiples of the kernel's blocks; the output error stays within torch's own SDPA error on the same inputs and the
log-sum-exp is right. Plan level: prefill chunks behind one cached prefix become a SharedPrefixChunks group whose
output equals the plain path's, mixed with decodes (cascade groups, which then read their prefix and their own
pages in place with the native kernels). The kernel-level accuracy runs on the main build and on its AVX2 variant
(tests/model/native_builds.py), so the AVX2 kernels are checked on AVX-512 CPUs too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import native
from prefixkv.model.attention import (
    NativeCascadeDecodes,
    NativeChunk,
    SharedPrefixChunks,
    StepPlanner,
    paged_attention,
)
from prefixkv.model.options import KernelOptions
from tests import kernels
from tests.model.helpers import shared_prefix_step
from tests.model.native_builds import AVX2, MAIN, module

pytestmark = kernels.NATIVE_ATTENTION

KVH, GROUP, D = 3, 3, 64


def reference(q, pool, slots, q_pos, scale):  # any head_dim: q's last dim
    """float32 attention of q [R, H, d] over pool slots, row r seeing keys j <= q_pos[r]: (out, lse)."""
    k = pool[0][:, slots].float().repeat_interleave(GROUP, 0)  # [H, L, d]
    v = pool[1][:, slots].float().repeat_interleave(GROUP, 0)
    scores = torch.einsum("rhd,hld->hrl", q.float(), k) * scale
    visible = torch.arange(len(slots))[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hrl,hld->rhd", torch.softmax(scores, -1), v)
    return out, torch.logsumexp(scores, -1).transpose(0, 1), visible


@pytest.mark.parametrize("build", [MAIN, pytest.param(AVX2, id="avx2_build")])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "context, n, see_all",
    [(0, 1, False), (0, 7, False), (0, 130, False), (13, 50, False), (200, 1, False), (100, 33, True), (64, 64, True)],
)
def test_kernel_matches_reference(context, n, see_all, d, build):
    gen = torch.Generator().manual_seed(context * 1000 + n)
    num_slots = 1024
    pool = torch.randn(2, KVH, num_slots, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_slots, generator=gen)[: context + n]  # scattered, as pages of a used pool are
    q = torch.randn(n, KVH * GROUP, d, generator=gen).to(torch.bfloat16)
    if see_all:  # rows that see every key (a shared prefix): the positions only need to reach the last key
        q_pos = torch.full((n,), context + n - 1, dtype=torch.long)
    else:
        q_pos = torch.arange(context, context + n)
    scale = d**-0.5
    out, lse = module(build).flash_attention(q, pool, slots, q_pos, scale)
    want, want_lse, visible = reference(q, pool, slots, q_pos, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (n, KVH * GROUP)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], pool[0][:, slots][None], pool[1][:, slots][None], attn_mask=visible, enable_gqa=True
    )[0].transpose(0, 1)
    torch_error = (sdpa.float() - want).abs().max().item()
    assert (out.float() - want).abs().max().item() <= max(1.5 * torch_error, 1e-2)
    torch.testing.assert_close(lse, want_lse, atol=5e-3, rtol=0)


def test_kernel_rejects_what_it_cannot_run():
    pool = torch.zeros(2, KVH, 64, D, dtype=torch.bfloat16)
    q = torch.zeros(4, KVH * GROUP, D, dtype=torch.bfloat16)
    slots, q_pos = torch.arange(4), torch.arange(4)
    kernel = native.module().flash_attention
    with pytest.raises(RuntimeError, match="bf16"):
        kernel(q.float(), pool.float(), slots, q_pos, 1.0)
    with pytest.raises(RuntimeError, match="q_pos"):
        kernel(q, pool, slots, q_pos[:3], 1.0)
    with pytest.raises(RuntimeError, match="head_dim 64 and 128"):
        kernel(q[..., :32], pool[..., :32], slots, q_pos, 1.0)
    with pytest.raises(RuntimeError, match="D = 128"):  # the query's dim picks the build; the pool must match it
        kernel(torch.zeros(4, KVH * GROUP, 128, dtype=torch.bfloat16), pool, slots, q_pos, 1.0)


@pytest.mark.parametrize("page_size", [16, 1])
def test_shared_prefix_chunks_equal_the_plain_path(page_size):
    counts, starts, tables = shared_prefix_step(page_size)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(2, KVH, 2048, D, generator=gen).to(torch.bfloat16)
    t = sum(counts)
    q = torch.randn(t, KVH * GROUP, D, generator=gen).to(torch.bfloat16)
    kv = torch.randn(t, 2, KVH, D, generator=gen).to(torch.bfloat16)
    plain = KernelOptions(flash_lse=True)
    fast = KernelOptions(flash_lse=True, cascade_decodes=True, native_attention=True, shared_prefill=True)
    outs, plans = [], []
    for options in (plain, fast):
        plan = StepPlanner(options, page_size, torch.bfloat16, 2 * KVH * D).plan(counts, starts, tables)
        outs.append(paged_attention(q, kv, pool.clone(), plan, D**-0.5))
        plans.append(plan)
    (shared,) = plans[1].groups_of(SharedPrefixChunks)
    first = 3  # rows of the prefill chunks start after the 3 decodes
    chunk_rows = [
        list(range(first, first + 20)),
        list(range(first + 29, first + 62)),
        list(range(first + 62, first + 67)),
    ]
    assert shared.rows.tolist() == sum(chunk_rows, [])
    assert len(shared.prefix_slots) == 96 and len(plans[1].groups_of(NativeChunk)) == 2
    (cascade,) = plans[1].groups_of(NativeCascadeDecodes)
    assert len(cascade.prefix_slots) == 96 and cascade.suffix_lens.tolist() == [5, 25]
    answered = sorted(
        r
        for g in plans[1].groups
        for r in (list(range(g.rows.start, g.rows.stop)) if isinstance(g.rows, slice) else g.rows.tolist())
    )
    assert answered == list(range(t))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=3e-2, rtol=0)
