"""Row groups of a step, each with its own `attend`: the planner chose them, a group only computes.

Every group reads the step's new queries and K/V and this layer's pool, and returns the attention output of its
own rows ([rows, heads, head_dim]); `rows` is a slice of the step's rows, or a tensor of row indices where a
group's members are not adjacent (cascade members, or the decodes left beside cascade groups). What a group may
not do is look at the device, the dtype or a global to pick a path: its fields say everything (the planner set
them from the frozen KernelOptions).

- InPlaceDecodes: the native kernel reads each decode's pages where they lie (nothing gathered); cache-invariant,
  with the prefill kernel's arithmetic (paged_flash_decode), so a 1-token chunk equals that row of a longer one.
- PaddedDecodes: decodes gathered and padded to the group's longest context, one SDPA call; each query head group
  is laid out as rows of its kv head ([B, kv_heads, group, d]), so no GQA expansion is needed.
- CascadeDecodes: decodes behind the same leading pages attend to that prefix once (queries of all members as rows
  of one product per kv head), to their own suffixes apart, and merge the two exactly (see merge.py).
- NativeCascadeDecodes: the same with the native kernels, the prefix and each suffix read where they lie.
- PrefillChunk: causal attention over the chunk's own K/V, or, after cached tokens, one call over the whole context
  read from the pool with an offset-causal mask.
- SplitChunk: a chunk after cached tokens attends to the cached part (all visible, read as a view of the pool when
  its slots are back to back) and to its own K/V (causal) in two calls merged by log-sum-exp.
- NativeChunk: a chunk (fresh or after cached tokens) attended by the native bf16 kernel straight from the pool.
- SharedPrefixChunks: chunks behind the same cached pages attend to them once, stacked, then to their own parts
  (merged by log-sum-exp, or, cache-invariant, continuing each row's softmax state).
Gathered K/V go into one workspace reused by every layer: fresh large allocations are slow on CPU.
The native groups carry `isa`, which products the kernels run (the build's vector products or AMX tiles): one value
for every group of an engine, so each row is computed alike in a decode and in a prefill.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixkv.model import native
from prefixkv.model.attention.merge import merge_by_lse, merge_unnormalised
from prefixkv.model.options import FLASH_WITH_LSE

Rows = slice | torch.Tensor  # the step rows a group answers for (a tensor: row indices, in the group's order)
# the native attention kernels' isa argument (csrc/attention/flash_attention.cpp): the build's vector products
# (AVX512_BF16 dot products, or float32 FMAs on an AVX2 build) or AMX tiles
NATIVE_VECTOR, NATIVE_AMX = 0, 1


def take_rows(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def gather(kv_layer: torch.Tensor, slots: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """kv_layer [2, KVH, S, d] -> [2, KVH, len(slots), d] gathered into the workspace (one index_select)."""
    two, kv_heads, _, head_dim = kv_layer.shape
    out = workspace[: two * kv_heads * len(slots) * head_dim].view(two * kv_heads, len(slots), head_dim)
    torch.index_select(kv_layer.view(two * kv_heads, -1, head_dim), 1, slots, out=out)
    return out.view(two, kv_heads, len(slots), head_dim)


@dataclass(slots=True)
class PoolRange:
    """Positions [0, length) of one request in the pool: a view when their slots are one ascending run (pages
    allocated back to back, as from a fresh pool or a prefix computed in one go), else gathered by `slots`."""

    length: int
    first_slot: int | None  # set when the slots are back to back
    slots: torch.Tensor | None  # set otherwise

    @property
    def workspace_slots(self) -> int:
        return 0 if self.slots is None else self.length

    def read(self, kv_layer: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
        """[2, KVH, length, d]"""
        if self.slots is not None:
            return gather(kv_layer, self.slots, workspace)
        assert self.first_slot is not None
        return kv_layer.narrow(2, self.first_slot, self.length)


@dataclass(slots=True)
class InPlaceDecodes:
    """Single-token decodes attended by the native kernel straight from their pages."""

    rows: Rows
    page_table: torch.Tensor  # [B, max_pages] int64, rows padded with the pad page
    context_lens: torch.Tensor  # [B] int64: positions [0, start_pos + 1) are attended
    page_size: int
    invariant: bool  # bf16: the prefill kernel's arithmetic (paged_flash_decode), else the plain decode kernel
    isa: int = NATIVE_VECTOR  # which products paged_flash_decode runs (KernelOptions.amx_attention)

    workspace_slots = 0

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        kernels, qd = native.module(), take_rows(q, self.rows)
        args = (qd, kv_layer, self.page_table, self.context_lens, self.page_size, scale)
        if self.invariant:
            return kernels.paged_flash_decode(*args, isa=self.isa)[0]
        return kernels.paged_decode_attention(*args)


@dataclass(slots=True)
class PaddedDecodes:
    """Single-token decodes gathered and padded to max_len context slots, one SDPA call."""

    rows: Rows
    max_len: int
    slots: torch.Tensor  # [B * max_len] flattened padded context slots (padding reads the pad page)
    mask: torch.Tensor  # [B, 1, 1, max_len] additive mask hiding the padding

    @property
    def workspace_slots(self) -> int:
        return len(self.slots)

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        kv_heads, head_dim = kv_layer.shape[1], kv_layer.shape[3]
        qd = take_rows(q, self.rows)
        b, num_heads = qd.shape[0], qd.shape[1]
        gathered = gather(kv_layer, self.slots, workspace).view(2, kv_heads, b, self.max_len, head_dim)
        kd, vd = gathered[0].transpose(0, 1), gathered[1].transpose(0, 1)  # [B, KVH, L, d], L x d contiguous
        qd = qd.view(b, kv_heads, num_heads // kv_heads, head_dim)  # heads of kv head j = rows of group j
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.mask, scale=scale)
        return od.reshape(b, num_heads, head_dim)


@dataclass(slots=True)
class CascadeDecodes:
    """Decodes sharing context positions [0, prefix_len) (the same leading pages): the prefix is attended once.

    Every member's own positions [prefix_len, start_pos + 1) are padded to suffix_len slots.
    """

    rows: Rows
    prefix_len: int
    prefix_slots: torch.Tensor  # [prefix_len]
    suffix_len: int
    suffix_slots: torch.Tensor  # [B * suffix_len] flattened padded slots (padding reads the pad page)
    suffix_mask: torch.Tensor  # [B, 1, 1, suffix_len] additive mask hiding the padding
    flash: bool  # torch's CPU flash kernel with log-sum-exp, else plain float32 ops

    @property
    def workspace_slots(self) -> int:
        return max(self.prefix_len, len(self.suffix_slots))

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        """Shared prefix once, own suffixes, exact merge (float32).

        The prefix is one attention with the queries of every member as rows of their kv head ([KVH, B*g, d]
        against [KVH, Lp, d]: real GEMMs, K/V gathered once); the suffixes are one padded, masked batched call.
        """
        qc = take_rows(q, self.rows)
        if not self.flash:
            return self._attend_reference(qc, kv_layer, workspace, scale)
        b, num_heads, head_dim = qc.shape
        kv_heads = kv_layer.shape[1]
        group = num_heads // kv_heads

        prefix = gather(kv_layer, self.prefix_slots, workspace)  # [2, KVH, Lp, d]
        qp = qc.view(b, kv_heads, group, head_dim).transpose(0, 1).reshape(1, kv_heads, b * group, head_dim)
        o1, lse1 = FLASH_WITH_LSE(qp, prefix[0].unsqueeze(0), prefix[1].unsqueeze(0), scale=scale)
        o1 = o1.reshape(kv_heads, b, group, head_dim).transpose(0, 1)  # [B, KVH, g, d]
        lse1 = lse1.reshape(kv_heads, b, group, 1).transpose(0, 1)

        suffix = gather(kv_layer, self.suffix_slots, workspace).view(2, kv_heads, b, self.suffix_len, head_dim)
        o2, lse2 = FLASH_WITH_LSE(
            qc.view(b, kv_heads, group, head_dim),
            suffix[0].transpose(0, 1),
            suffix[1].transpose(0, 1),
            attn_mask=self.suffix_mask,
            scale=scale,
        )
        return merge_by_lse(o1, lse1, o2, lse2.unsqueeze(-1), qc.dtype).reshape(b, num_heads, head_dim)

    def _attend_reference(self, q, kv_layer, workspace, scale) -> torch.Tensor:
        """The same with plain float32 ops (unnormalised softmax pieces: max m, sum l, output o); any device."""
        b, num_heads, head_dim = q.shape
        kv_heads = kv_layer.shape[1]
        group = num_heads // kv_heads
        qf = q.view(b, kv_heads, group, head_dim).float() * scale  # [B, KVH, g, d]

        prefix = gather(kv_layer, self.prefix_slots, workspace).float()  # [2, KVH, Lp, d] (a copy unless fp32)
        qp = qf.transpose(0, 1).reshape(kv_heads, b * group, head_dim)
        s1 = torch.matmul(qp, prefix[0].transpose(1, 2))  # [KVH, B*g, Lp]
        m1 = s1.amax(-1, keepdim=True)
        p1 = s1.sub_(m1).exp_()
        l1 = p1.sum(-1, keepdim=True)
        o1 = torch.matmul(p1, prefix[1])  # [KVH, B*g, d], unnormalised
        del prefix, s1, p1  # frees the workspace (fp32: the gathered view) for the suffix gather

        def per_member(t: torch.Tensor) -> torch.Tensor:  # [KVH, B*g, x] -> [B, KVH, g, x]
            return t.view(kv_heads, b, group, t.shape[-1]).transpose(0, 1)

        m1, l1, o1 = per_member(m1), per_member(l1), per_member(o1)

        suffix = gather(kv_layer, self.suffix_slots, workspace).view(2, kv_heads, b, self.suffix_len, head_dim)
        ks = suffix[0].transpose(0, 1).float()  # [B, KVH, S, d]
        vs = suffix[1].transpose(0, 1).float()
        s2 = torch.matmul(qf, ks.transpose(-1, -2)).add_(self.suffix_mask)  # [B, KVH, g, S]
        m2 = s2.amax(-1, keepdim=True)
        p2 = s2.sub_(m2).exp_()
        l2 = p2.sum(-1, keepdim=True)
        o2 = torch.matmul(p2, vs)  # [B, KVH, g, d]
        return merge_unnormalised(m1, l1, o1, m2, l2, o2).to(q.dtype).reshape(b, num_heads, head_dim)


@dataclass(slots=True)
class NativeCascadeDecodes:
    """CascadeDecodes with the native kernels, nothing gathered: the members' queries stacked against the shared
    prefix (flash_attention, bf16), each member's own pages after it in place (its page table starting after the
    shared pages: prefix_len is whole pages). Invariant: the prefix hands each row's softmax state to
    paged_flash_decode, which continues it (prefix_len a multiple of 64: bit for bit one pass); else the two
    pieces are merged by log-sum-exp."""

    rows: Rows
    prefix_slots: torch.Tensor  # [prefix_len]
    prefix_q_pos: torch.Tensor  # [B] prefix_len - 1: every member sees the whole prefix
    suffix_table: torch.Tensor  # [B, pages] each member's pages after the shared ones (padded with the pad page)
    suffix_lens: torch.Tensor  # [B] start_pos + 1 - prefix_len
    page_size: int
    invariant: bool
    isa: int = NATIVE_VECTOR

    workspace_slots = 0

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        kernels = native.module()
        qc = take_rows(q, self.rows).contiguous()
        if self.invariant:
            state = kernels.flash_attention(
                qc, kv_layer, self.prefix_slots, self.prefix_q_pos, scale, return_state=True, isa=self.isa
            )[2]
            return kernels.paged_flash_decode(
                qc, kv_layer, self.suffix_table, self.suffix_lens, self.page_size, scale, state, isa=self.isa
            )[0]
        o1, lse1 = kernels.flash_attention(qc, kv_layer, self.prefix_slots, self.prefix_q_pos, scale, isa=self.isa)
        o2, lse2 = kernels.paged_decode_attention_lse(
            qc, kv_layer, self.suffix_table, self.suffix_lens, self.page_size, scale
        )
        return merge_by_lse(o1, lse1.unsqueeze(-1), o2, lse2.unsqueeze(-1), qc.dtype)


def _chunk_tensors(q, kv, rows: slice):
    """The chunk's queries [1, H, n, d] and own keys / values [1, KVH, n, d]."""
    qp = q[rows].transpose(0, 1).unsqueeze(0)
    kp = kv[rows, 0].transpose(0, 1).unsqueeze(0)
    vp = kv[rows, 1].transpose(0, 1).unsqueeze(0)
    return qp, kp, vp


@dataclass(slots=True)
class PrefillChunk:
    """Positions [start_pos, start_pos + n) of one request (rows of the step).

    Without `context` the chunk starts its request: causal attention over its own K/V. With it, positions
    [0, start_pos + n) are read from the pool (the chunk's own K/V were written there first) under `mask`.
    """

    rows: slice
    start_pos: int
    context: PoolRange | None
    mask: torch.Tensor | None  # additive [n, start_pos + n] offset-causal mask, with context

    @property
    def workspace_slots(self) -> int:
        return 0 if self.context is None else self.context.workspace_slots

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        qp, kp, vp = _chunk_tensors(q, kv, self.rows)
        if self.context is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ctx = self.context.read(kv_layer, workspace)
            op = F.scaled_dot_product_attention(
                qp, ctx[0].unsqueeze(0), ctx[1].unsqueeze(0), attn_mask=self.mask, scale=scale, enable_gqa=True
            )
        return op[0].transpose(0, 1)


@dataclass(slots=True)
class SplitChunk:
    """Positions [start_pos, start_pos + n) of one request after `context` = positions [0, start_pos) cached.

    The cached part lays the query heads of each kv head out as rows ([1, KVH, g*n, d]: no GQA expansion of the
    long context, and enough rows for the flash kernel's packed path); the own part is small and expanded. Without
    the flash kernel (flash=False) both parts go into one masked call instead.
    """

    rows: slice
    start_pos: int
    context: PoolRange
    flash: bool

    @property
    def workspace_slots(self) -> int:
        return self.context.workspace_slots

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        qp, k_own, v_own = _chunk_tensors(q, kv, self.rows)
        ctx = self.context.read(kv_layer, workspace)
        k_ctx, v_ctx = ctx[0].unsqueeze(0), ctx[1].unsqueeze(0)
        if not self.flash:
            k, v = torch.cat((k_ctx, k_own), dim=2), torch.cat((v_ctx, v_own), dim=2)
            n, total = qp.shape[2], k.shape[2]
            mask = torch.ones(n, total, dtype=torch.bool, device=qp.device).tril(total - n)
            op = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            return op[0].transpose(0, 1)
        _, num_heads, n, head_dim = qp.shape
        kv_heads = k_ctx.shape[1]
        group = num_heads // kv_heads
        o1, lse1 = FLASH_WITH_LSE(qp.reshape(1, kv_heads, group * n, head_dim), k_ctx, v_ctx, scale=scale)
        o1, lse1 = o1.reshape(1, num_heads, n, head_dim), lse1.reshape(1, num_heads, n, 1)
        k_own = k_own.repeat_interleave(group, dim=1)
        v_own = v_own.repeat_interleave(group, dim=1)
        o2, lse2 = FLASH_WITH_LSE(qp, k_own, v_own, is_causal=True, scale=scale)
        return merge_by_lse(o1, lse1, o2, lse2.unsqueeze(-1), qp.dtype)[0].transpose(0, 1)


@dataclass(slots=True)
class NativeChunk:
    """A prefill chunk attended by the native bf16 kernel: its queries against positions [0, start_pos + n), read
    from the pool by slot (the chunk's own K/V are written there first), row r seeing positions <= q_pos[r]."""

    rows: slice
    slots: torch.Tensor  # [start_pos + n] slot of each position
    q_pos: torch.Tensor  # [n] the rows' positions
    isa: int = NATIVE_VECTOR

    workspace_slots = 0

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        out, _ = native.module().flash_attention(q[self.rows], kv_layer, self.slots, self.q_pos, scale, isa=self.isa)
        return out


@dataclass(slots=True)
class SharedPrefixChunks:
    """Prefill chunks behind the same cached leading pages (positions [0, prefix_len)) attend to them once.

    The queries of every member are stacked and attend to the shared prefix in one native call (its K/V packed
    once for all members, and one call's worth of work to split over the threads, instead of one small call per
    chunk); each member then attends to its own positions [prefix_len, start_pos + n), causally, and the two
    pieces are merged by log-sum-exp (merge.py), or, invariant, the prefix hands each row's softmax state to its
    own part, which continues it (prefix_len a multiple of 64: bit for bit one pass over the whole context). The
    prefill counterpart of CascadeDecodes.
    """

    rows: Rows  # every member's rows, member after member
    prefix_slots: torch.Tensor  # [prefix_len]
    prefix_q_pos: torch.Tensor  # [rows] prefix_len - 1: every row sees the whole prefix
    members: list[tuple[slice, torch.Tensor, torch.Tensor]]  # (rows within the group, own slots, positions - prefix)
    invariant: bool
    isa: int = NATIVE_VECTOR

    workspace_slots = 0

    def attend(self, q, kv, kv_layer, workspace, scale) -> torch.Tensor:
        kernel = functools.partial(native.module().flash_attention, isa=self.isa)
        qg = take_rows(q, self.rows)
        if self.invariant:
            state = kernel(qg, kv_layer, self.prefix_slots, self.prefix_q_pos, scale, return_state=True)[2]
            out = torch.empty_like(qg)
            for local, slots, q_pos in self.members:
                out[local] = kernel(qg[local], kv_layer, slots, q_pos, scale, state[local])[0]
            return out
        o1, lse1 = kernel(qg, kv_layer, self.prefix_slots, self.prefix_q_pos, scale)
        o2, lse2 = torch.empty_like(o1), torch.empty_like(lse1)
        for local, slots, q_pos in self.members:
            o2[local], lse2[local] = kernel(qg[local], kv_layer, slots, q_pos, scale)
        return merge_by_lse(o1, lse1.unsqueeze(-1), o2, lse2.unsqueeze(-1), qg.dtype)


RowGroup = (
    InPlaceDecodes
    | PaddedDecodes
    | CascadeDecodes
    | NativeCascadeDecodes
    | PrefillChunk
    | SplitChunk
    | NativeChunk
    | SharedPrefixChunks
)
