"""Paged attention over the KV pool, with everything index-shaped computed once per step.

KV pool layout: one tensor [num_layers, 2 (k, v), num_kv_heads, num_slots, head_dim]. Slot of position p of a
request = page_table[p // page_size] * page_size + p % page_size. Keeping slots as the second-to-last axis
means that gathering a request's slots yields [kv_heads, L, head_dim] blocks that feed SDPA without a copy.

Rows of a step are ordered decodes first (one token each, shortest context first), then prefill chunks.
Decodes are padded to a common length and share one SDPA call per layer: each query head group is laid out as
rows of its kv head ([B, kv_heads, group, d]), so no GQA expansion is needed. When context lengths differ a
lot, decodes are split into a few length groups so that padding never more than doubles the work.
Prefill chunks run one SDPA each; a chunk with no cached context uses the fast causal kernel on its own K/V,
a chunk after cached tokens gathers its context and uses an offset causal mask.
Gathered K/V go into one workspace reused by every layer: fresh large allocations are slow on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# a decode group is closed when the next context is longer than _GROUP_GROWTH times the group's shortest and
# than _MIN_SPLIT_LEN (below that, padding is cheaper than another SDPA call per layer)
_GROUP_GROWTH = 2.0
_MIN_SPLIT_LEN = 256


@dataclass
class DecodeGroup:
    """Rows [row_start, row_end) are single-token decodes padded to max_len context slots."""

    row_start: int
    row_end: int
    max_len: int
    slots: torch.Tensor  # [B * max_len] flattened padded context slots (padding reads slot 0)
    mask: torch.Tensor  # [B, 1, 1, max_len] additive mask hiding the padding


@dataclass
class PrefillChunk:
    """Rows [row_start, row_end) of the step are positions [start_pos, start_pos + n) of one request."""

    row_start: int
    row_end: int
    start_pos: int
    context_slots: torch.Tensor | None  # slots of positions [0, start_pos + n); None when start_pos == 0
    mask: torch.Tensor | None  # additive [n, start_pos + n] offset-causal mask; None when start_pos == 0


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step; built once, read by every layer."""

    slot_mapping: torch.Tensor  # [T] slot where each row's new K/V goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    workspace: torch.Tensor  # flat scratch for gathered K/V, reused by every layer (no per-layer allocation)

    @staticmethod
    def build(
        token_counts: list[int],
        start_positions: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        gather_width: int,
        workspace: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Items must already be ordered 1-token items first, by ascending start_pos (see ModelRunner).

        gather_width: elements per gathered slot (2 * kv_heads * head_dim). `workspace` is reused when it is
        large enough (the runner keeps one across steps); the returned metadata holds the one actually used.
        """
        num_decodes = 0
        while num_decodes < len(token_counts) and token_counts[num_decodes] == 1:
            num_decodes += 1
        slot_parts: list[np.ndarray] = []

        decodes: list[DecodeGroup] = []
        group_start = 0
        for i in range(num_decodes + 1):
            length = start_positions[i] + 1 if i < num_decodes else 0
            if i == num_decodes or (
                length > _MIN_SPLIT_LEN and length > _GROUP_GROWTH * (start_positions[group_start] + 1)
            ):
                if i > group_start:
                    group, group_slots = _decode_group(
                        group_start, i, start_positions, page_tables, page_size, device, dtype
                    )
                    decodes.append(group)
                    slot_parts.append(group_slots)
                group_start = i

        prefills: list[PrefillChunk] = []
        row = num_decodes
        for i in range(num_decodes, len(token_counts)):
            n, start = token_counts[i], start_positions[i]
            pt = np.asarray(page_tables[i], dtype=np.int64)
            pos = np.arange(start + n, dtype=np.int64)
            slots = pt[pos // page_size] * page_size + pos % page_size
            slot_parts.append(slots[start:])
            context_slots = mask = None
            if start > 0:
                context_slots = torch.from_numpy(slots).to(device)
                q_pos = np.arange(start, start + n)[:, None]
                m = np.where(pos[None, :] <= q_pos, 0.0, -np.inf).astype(np.float32)
                mask = torch.from_numpy(m).to(device=device, dtype=dtype)
            prefills.append(PrefillChunk(row, row + n, start, context_slots, mask))
            row += n

        slot_mapping = torch.from_numpy(np.concatenate(slot_parts)).to(device)
        most_slots = max(
            [0]
            + [(g.row_end - g.row_start) * g.max_len for g in decodes]
            + [len(c.context_slots) for c in prefills if c.context_slots is not None]
        )
        need = most_slots * gather_width
        if workspace is None or workspace.numel() < need or workspace.dtype != dtype:
            workspace = torch.empty(max(need + need // 4, 1), dtype=dtype, device=device)  # headroom: fewer regrows
        return AttentionMetadata(slot_mapping, decodes, prefills, workspace)


def _decode_group(start, end, start_positions, page_tables, page_size, device, dtype):
    """Padded slot table and mask for decodes [start, end); also the slots their new tokens go to."""
    lens = np.asarray(start_positions[start:end], dtype=np.int64) + 1
    max_len = int(lens.max())
    max_pages = -(-max_len // page_size)
    table = np.zeros((end - start, max_pages), dtype=np.int64)
    for b in range(end - start):
        pt = page_tables[start + b][:max_pages]
        table[b, : len(pt)] = pt
    pos = np.arange(max_len, dtype=np.int64)
    slots = table[:, pos // page_size] * page_size + pos % page_size  # [B, Lmax]
    valid = pos[None, :] < lens[:, None]
    slots = np.where(valid, slots, 0)  # padding reads slot 0 (finite: the pool is zero-initialised)
    new_slots = slots[np.arange(end - start), lens - 1]
    mask = torch.from_numpy(np.where(valid, 0.0, -np.inf).astype(np.float32))
    group = DecodeGroup(
        start, end, max_len,
        torch.from_numpy(slots.reshape(-1)).to(device),
        mask.to(device=device, dtype=dtype).view(end - start, 1, 1, max_len),
    )
    return group, new_slots


def _gather(kv_layer: torch.Tensor, slots: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """kv_layer [2, KVH, S, d] -> [2, KVH, len(slots), d] gathered into the workspace (one index_select)."""
    two, kv_heads, _, head_dim = kv_layer.shape
    out = workspace[: two * kv_heads * len(slots) * head_dim].view(two * kv_heads, len(slots), head_dim)
    torch.index_select(kv_layer.view(two * kv_heads, -1, head_dim), 1, slots, out=out)
    return out.view(two, kv_heads, len(slots), head_dim)


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, d], kv [T, 2, KVH, d] (new keys and values), kv_layer [2, KVH, slots, d] (this layer's pool).

    Writes the new K/V into their slots, then attends; returns [T, H, d].
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv.shape[2]
    group = num_heads // kv_heads
    kv_layer.index_copy_(2, meta.slot_mapping, kv.permute(1, 2, 0, 3))
    outputs: list[torch.Tensor] = []

    for g in meta.decodes:
        b = g.row_end - g.row_start
        gathered = _gather(kv_layer, g.slots, meta.workspace).view(2, kv_heads, b, g.max_len, head_dim)
        kd, vd = gathered[0].transpose(0, 1), gathered[1].transpose(0, 1)  # [B, KVH, L, d], L x d contiguous
        qd = q[g.row_start : g.row_end].view(b, kv_heads, group, head_dim)  # heads of kv head j = rows of group j
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        outputs.append(od.reshape(b, num_heads, head_dim))

    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.context_slots is None:
            kp = kv[rows, 0].transpose(0, 1).unsqueeze(0)
            vp = kv[rows, 1].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            gathered = _gather(kv_layer, chunk.context_slots, meta.workspace)
            kp, vp = gathered[0].unsqueeze(0), gathered[1].unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        outputs.append(op[0].transpose(0, 1))

    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
