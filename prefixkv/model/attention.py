"""Paged attention over the KV pool, with everything index-shaped computed once per step.

KV pool layout: one tensor [num_layers, 2 (k, v), num_kv_heads, num_slots, head_dim]. Slot of position p of a
request = page_table[p // page_size] * page_size + p % page_size. Keeping slots as the second-to-last axis
means that gathering a request's slots yields [kv_heads, L, head_dim] blocks that feed SDPA without a copy.

Rows of a step are ordered decodes first (one token each, shortest context first), then prefill chunks.
Where the native kernel is built (prefixkv.model.native, CPU), decodes attend straight from their pages in one
call per layer, nothing gathered. Otherwise they are gathered, padded to a common length and share one SDPA call
per layer: each query head group is laid out as rows of its kv head ([B, kv_heads, group, d]), so no GQA expansion
is needed, and when context lengths differ a lot, decodes are split into a few length groups so that padding never
more than doubles the work.
Prefill chunks run one SDPA each; a chunk with no cached context uses the fast causal kernel on its own K/V,
a chunk after cached tokens gathers its context and uses an offset causal mask. Below float32 (split mode) such a
chunk instead attends to the cached positions (no mask) and to its own K/V (causal) in two calls merged exactly
by log-sum-exp: the cached slots are then read as a view of the pool whenever they are back to back (the chunk's
own pages usually are not), and the cached part is one call with the query heads of each kv head as rows.
Gathered K/V go into one workspace reused by every layer: fresh large allocations are slow on CPU.

Cascade attention (opt-in per step, see `AttentionMetadata.build(cascade=...)`): decodes whose page tables start
with the same pages (many requests behind one cached system prompt) would each gather the same prefix K/V every
layer. Instead, a cascade group attends to the shared prefix ONCE (queries of all members as rows of one GEMM per
kv head), attends to each member's own remaining slots separately, and merges the two softmax pieces exactly
(running max / sum, in float32). This changes the floating-point summation order, so the runner enables it by
default only for bf16/fp16 (fp32 greedy output must stay identical with prefix caching on and off).
Decode rows are then permuted so that every group (cascade or padded) is a contiguous range; `decode_order`
maps back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from prefixkv.model import native

# a decode group is closed when the next context is longer than _GROUP_GROWTH times the group's shortest and
# than _MIN_SPLIT_LEN (below that, padding is cheaper than another SDPA call per layer)
_GROUP_GROWTH = 2.0
_MIN_SPLIT_LEN = 256
# a cascade group needs at least 2 members sharing at least this many leading tokens (whole pages), and must
# gather at most this fraction of the slots its members would gather on their own (suffixes are padded to the
# group's longest, so a group of very different lengths may not pay)
_CASCADE_MIN_PREFIX = 64
_CASCADE_MAX_GATHER = 0.75


@dataclass
class DecodeGroup:
    """Rows [row_start, row_end) are single-token decodes padded to max_len context slots."""

    row_start: int
    row_end: int
    max_len: int
    slots: torch.Tensor  # [B * max_len] flattened padded context slots (padding reads slot 0)
    mask: torch.Tensor  # [B, 1, 1, max_len] additive mask hiding the padding


@dataclass
class InPlaceDecodes:
    """Rows [row_start, row_end) are single-token decodes attended by the native kernel straight from the pool."""

    row_start: int
    row_end: int
    page_table: torch.Tensor  # [B, max_pages] int64, rows padded with page 0
    context_lens: torch.Tensor  # [B] int64: positions [0, start_pos + 1) are attended
    page_size: int


@dataclass
class CascadeGroup:
    """Rows [row_start, row_end) (of the permuted decode rows) share the context positions [0, prefix_len).

    Every member's own positions [prefix_len, start_pos + 1) are padded to suffix_len slots.
    """

    row_start: int
    row_end: int
    prefix_len: int
    prefix_slots: torch.Tensor  # [prefix_len]
    suffix_len: int
    suffix_slots: torch.Tensor  # [B * suffix_len] flattened padded slots (padding reads slot 0)
    suffix_mask: torch.Tensor  # [B, 1, 1, suffix_len] additive mask hiding the padding


@dataclass
class PrefillChunk:
    """Rows [row_start, row_end) of the step are positions [start_pos, start_pos + n) of one request.

    Positions [0, context_len) are read from the pool: 0 when the chunk starts the request (its own K/V suffice),
    start_pos in split mode (the chunk's own K/V come from the step, see `AttentionMetadata.build`), else
    start_pos + n with the offset-causal `mask`.
    """

    row_start: int
    row_end: int
    start_pos: int
    context_len: int
    context_slots: torch.Tensor | None  # slots of the context positions, when they must be gathered
    # when those slots are one ascending run (pages allocated back to back, as from a fresh pool or a cached
    # prefix computed in one go), its first slot: attention reads a view of the pool instead of a gathered copy
    context_first_slot: int | None
    mask: torch.Tensor | None  # additive [n, context_len] offset-causal mask (single-call mode only)


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step; built once, read by every layer."""

    slot_mapping: torch.Tensor  # [T] slot where each row's new K/V goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    workspace: torch.Tensor  # flat scratch for gathered K/V, reused by every layer (no per-layer allocation)
    cascades: list[CascadeGroup] = field(default_factory=list)
    # with cascades, decode rows are processed permuted (cascade groups first, then the padded groups):
    # permuted row r is step row decode_perm[r]; decode_order[i] = where step row i went
    decode_perm: torch.Tensor | None = None
    decode_order: torch.Tensor | None = None
    in_place: InPlaceDecodes | None = None  # decodes left to the native kernel (then `decodes` is empty)

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
        cascade: bool = False,
        split_context: bool = False,
        in_place_decodes: bool = False,
    ) -> AttentionMetadata:
        """Items must already be ordered 1-token items first, by ascending start_pos (see ModelRunner).

        gather_width: elements per gathered slot (2 * kv_heads * head_dim). `workspace` is reused when it is
        large enough (the runner keeps one across steps); the returned metadata holds the one actually used.
        cascade: attend to leading pages shared by several decodes once per group (see the module docstring).
        split_context: a prefill chunk after cached tokens attends to the cached context (no mask) and to its
        own K/V (causal) in two calls merged by log-sum-exp, so it reads the cached slots as one view of the pool
        when they are back to back, whereas the pages of the chunk itself usually lie elsewhere. Like cascade, it
        changes the summation order, so the runner uses it only below float32.
        in_place_decodes: decodes outside cascade groups are attended by the native kernel (prefixkv.model.native)
        reading their pages in place, instead of being gathered into padded length groups. Its result does not
        depend on where the pages lie, so it is used at every precision.
        """
        num_decodes = 0
        while num_decodes < len(token_counts) and token_counts[num_decodes] == 1:
            num_decodes += 1
        # new K/V of decode i go to the slot of position start_positions[i]
        slot_parts: list[np.ndarray] = [
            np.asarray(
                [page_tables[i][start_positions[i] // page_size] * page_size + start_positions[i] % page_size
                 for i in range(num_decodes)],
                dtype=np.int64,
            )
        ]

        cascades: list[CascadeGroup] = []
        rest = list(range(num_decodes))  # decodes left to the padded path (ascending start_pos)
        perm: list[int] = []
        if cascade and num_decodes >= 2:
            for members, prefix_pages in _cascade_groups(rest, start_positions, page_tables, page_size):
                cascades.append(_cascade_group(len(perm), members, prefix_pages, start_positions, page_tables,
                                               page_size, device, dtype))
                perm += members
            if cascades:
                taken = set(perm)
                rest = [i for i in rest if i not in taken]

        if in_place_decodes and rest:
            in_place = _in_place_decodes(len(perm), rest, start_positions, page_tables, page_size, device)
            decodes: list[DecodeGroup] = []
        else:
            in_place = None
            decodes = _length_groups(len(perm), rest, start_positions, page_tables, page_size, device, dtype)
        decode_perm = decode_order = None
        if cascades:
            perm += rest
            decode_perm = torch.tensor(perm, dtype=torch.long, device=device)
            decode_order = torch.from_numpy(np.argsort(np.asarray(perm))).to(device)

        prefills: list[PrefillChunk] = []
        row = num_decodes
        for i in range(num_decodes, len(token_counts)):
            n, start = token_counts[i], start_positions[i]
            pt = np.asarray(page_tables[i], dtype=np.int64)
            pos = np.arange(start + n, dtype=np.int64)
            slots = pt[pos // page_size] * page_size + pos % page_size
            slot_parts.append(slots[start:])
            context_len = 0 if start == 0 else (start if split_context else start + n)
            context_slots = mask = first_slot = None
            if context_len:
                ctx = slots[:context_len]
                if ctx[-1] - ctx[0] == context_len - 1 and (np.diff(ctx) == 1).all():
                    first_slot = int(ctx[0])
                else:
                    context_slots = torch.from_numpy(ctx).to(device)
            if context_len and not split_context:
                q_pos = np.arange(start, start + n)[:, None]
                m = np.where(pos[None, :] <= q_pos, 0.0, -np.inf).astype(np.float32)
                mask = torch.from_numpy(m).to(device=device, dtype=dtype)
            prefills.append(PrefillChunk(row, row + n, start, context_len, context_slots, first_slot, mask))
            row += n

        slot_mapping = torch.from_numpy(np.concatenate(slot_parts)).to(device)
        most_slots = max(
            [0]
            + [(g.row_end - g.row_start) * g.max_len for g in decodes]
            + [c.context_len for c in prefills if c.context_slots is not None]
            + [max(c.prefix_len, (c.row_end - c.row_start) * c.suffix_len) for c in cascades]
        )
        need = most_slots * gather_width
        if workspace is None or workspace.numel() < need or workspace.dtype != dtype:
            workspace = torch.empty(max(need + need // 4, 1), dtype=dtype, device=device)  # headroom: fewer regrows
        return AttentionMetadata(slot_mapping, decodes, prefills, workspace, cascades, decode_perm, decode_order,
                                 in_place)


def _padded_slots(members, offset, start_positions, page_tables, page_size):
    """Slots of positions [offset, start_pos + 1) of each member, padded to the longest: (slots [B, L], valid)."""
    ends = np.asarray([start_positions[i] + 1 for i in members], dtype=np.int64)
    width = int(ends.max()) - offset
    max_pages = -(-(offset + width) // page_size)
    table = np.zeros((len(members), max_pages), dtype=np.int64)
    for b, i in enumerate(members):
        pt = page_tables[i][:max_pages]
        table[b, : len(pt)] = pt
    pos = offset + np.arange(width, dtype=np.int64)
    slots = table[:, pos // page_size] * page_size + pos % page_size  # [B, width]
    valid = pos[None, :] < ends[:, None]
    return np.where(valid, slots, 0), valid  # padding reads slot 0 (finite: the pool is zero-initialised)


def _length_groups(row_start, members, start_positions, page_tables, page_size, device, dtype):
    """Padded decode groups over `members` (ascending start_pos): a group closes where padding would double work."""
    groups: list[DecodeGroup] = []
    group_start = 0
    for k in range(len(members) + 1):
        length = start_positions[members[k]] + 1 if k < len(members) else 0
        if k == len(members) or (
            length > _MIN_SPLIT_LEN and length > _GROUP_GROWTH * (start_positions[members[group_start]] + 1)
        ):
            if k > group_start:
                groups.append(_decode_group(row_start + group_start, members[group_start:k], start_positions,
                                            page_tables, page_size, device, dtype))
            group_start = k
    return groups


def _in_place_decodes(row_start, members, start_positions, page_tables, page_size, device):
    lens = np.asarray([start_positions[i] + 1 for i in members], dtype=np.int64)
    max_pages = int(-(-lens.max() // page_size))
    table = np.zeros((len(members), max_pages), dtype=np.int64)
    for b, i in enumerate(members):
        pages = page_tables[i][: -(-int(lens[b]) // page_size)]
        table[b, : len(pages)] = pages
    return InPlaceDecodes(row_start, row_start + len(members), torch.from_numpy(table).to(device),
                          torch.from_numpy(lens).to(device), page_size)


def _decode_group(row_start, members, start_positions, page_tables, page_size, device, dtype):
    """Padded slot table and mask for the decodes `members` (rows row_start onwards)."""
    slots, valid = _padded_slots(members, 0, start_positions, page_tables, page_size)
    b, max_len = slots.shape
    mask = torch.from_numpy(np.where(valid, 0.0, -np.inf).astype(np.float32))
    return DecodeGroup(
        row_start, row_start + b, max_len,
        torch.from_numpy(slots.reshape(-1)).to(device),
        mask.to(device=device, dtype=dtype).view(b, 1, 1, max_len),
    )


def _cascade_groups(decodes, start_positions, page_tables, page_size):
    """[(members, shared_pages)]: decodes whose page tables share >= _CASCADE_MIN_PREFIX leading tokens.

    Only pages lying entirely before every member's current position count (the current token's slot is
    written this step), and only groups that gather clearly fewer slots than their members alone
    (_CASCADE_MAX_GATHER). Members are grouped by their first page; when a group's common prefix is too short,
    it is split by the first page where its members diverge (so two big families behind one short shared
    start are both found).
    """
    min_pages = -(-_CASCADE_MIN_PREFIX // page_size)
    found = []

    def split(members: list[int], depth: int) -> None:
        # members share pages [0, depth); each candidate has at least min_pages full pages before its position
        by_page: dict[int, list[int]] = {}
        for i in members:
            by_page.setdefault(page_tables[i][depth], []).append(i)
        for sub in by_page.values():
            if len(sub) < 2:
                continue
            limit = min(start_positions[i] for i in sub) // page_size  # pages wholly before every position
            table = np.asarray([page_tables[i][:limit] for i in sub], dtype=np.int64)
            same = (table == table[0]).all(axis=0)
            shared = limit if same.all() else int(np.argmin(same))
            if shared >= min_pages:
                ends = [start_positions[i] + 1 for i in sub]
                cascade_slots = shared * page_size * (1 - len(sub)) + len(sub) * max(ends)
                if cascade_slots <= _CASCADE_MAX_GATHER * sum(ends):
                    found.append((sub, shared))
            elif shared < limit:
                split(sub, shared)

    split([i for i in decodes if start_positions[i] // page_size >= min_pages], 0)
    return found


def _cascade_group(row_start, members, prefix_pages, start_positions, page_tables, page_size, device, dtype):
    prefix_len = prefix_pages * page_size
    pt = np.asarray(page_tables[members[0]][:prefix_pages], dtype=np.int64)
    pos = np.arange(prefix_len, dtype=np.int64)
    prefix_slots = pt[pos // page_size] * page_size + pos % page_size
    slots, valid = _padded_slots(members, prefix_len, start_positions, page_tables, page_size)
    b, suffix_len = slots.shape
    mask = torch.from_numpy(np.where(valid, 0.0, -np.inf).astype(np.float32)).view(b, 1, 1, suffix_len)
    return CascadeGroup(
        row_start, row_start + b, prefix_len, torch.from_numpy(prefix_slots).to(device),
        suffix_len, torch.from_numpy(slots.reshape(-1)).to(device), mask.to(device=device, dtype=dtype),
    )


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

    if meta.decode_perm is not None:  # cascade groups: decode rows permuted so that every group is contiguous
        q_dec = q.index_select(0, meta.decode_perm)
        for c in meta.cascades:
            outputs.append(_cascade_attention(q_dec[c.row_start : c.row_end], kv_layer, c, meta.workspace, scale))
    else:
        q_dec = q

    if meta.in_place is not None:
        d = meta.in_place
        kernel = native.module()
        outputs.append(kernel.paged_decode_attention(q_dec[d.row_start : d.row_end], kv_layer, d.page_table,
                                                     d.context_lens, d.page_size, scale))

    for g in meta.decodes:
        b = g.row_end - g.row_start
        gathered = _gather(kv_layer, g.slots, meta.workspace).view(2, kv_heads, b, g.max_len, head_dim)
        kd, vd = gathered[0].transpose(0, 1), gathered[1].transpose(0, 1)  # [B, KVH, L, d], L x d contiguous
        qd = q_dec[g.row_start : g.row_end].view(b, kv_heads, group, head_dim)  # heads of kv head j = rows of group j
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        outputs.append(od.reshape(b, num_heads, head_dim))

    if meta.decode_order is not None:
        decoded = torch.cat(outputs, dim=0).index_select(0, meta.decode_order)
        outputs = [decoded]

    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_end)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        kp = kv[rows, 0].transpose(0, 1).unsqueeze(0)  # the chunk's own K/V [1, KVH, n, d]
        vp = kv[rows, 1].transpose(0, 1).unsqueeze(0)
        if chunk.context_len == 0:  # no cached context: causal attention over the chunk's own K/V
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if chunk.context_first_slot is not None:
                context = kv_layer.narrow(2, chunk.context_first_slot, chunk.context_len)
            else:
                context = _gather(kv_layer, chunk.context_slots, meta.workspace)
            kc, vc = context[0].unsqueeze(0), context[1].unsqueeze(0)
            if chunk.mask is not None:
                op = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
            else:
                op = _attend_split(qp, kc, vc, kp, vp, scale)
        outputs.append(op[0].transpose(0, 1))

    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


# CPU flash kernel that also returns the logsumexp of each row (what SDPA runs on CPU); None where unavailable
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, dtype) -> torch.Tensor:
    """Exact softmax merge of two attention pieces over disjoint keys: sum_i o_i * exp(lse_i - lse) (float32)."""
    lse = torch.logaddexp(lse1, lse2)
    return o1.float().mul_((lse1 - lse).exp_()).add_(o2.float().mul_((lse2 - lse).exp_())).to(dtype)


def _attend_split(q, k_ctx, v_ctx, k_own, v_own, scale):
    """q [1, H, n, d] over cached k/v_ctx [1, KVH, C, d] (all visible) and its own k/v_own [1, KVH, n, d] (causal).

    The cached part lays the query heads of each kv head out as rows ([1, KVH, g*n, d]: no GQA expansion of
    the long context, and enough rows for the flash kernel's packed path); the own part is small and expanded.
    """
    if _flash_with_lse is None or q.device.type != "cpu":
        k = torch.cat((k_ctx, k_own), dim=2)
        v = torch.cat((v_ctx, v_own), dim=2)
        n, total = q.shape[2], k.shape[2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    _, num_heads, n, head_dim = q.shape
    kv_heads = k_ctx.shape[1]
    group = num_heads // kv_heads
    o1, lse1 = _flash_with_lse(q.reshape(1, kv_heads, group * n, head_dim), k_ctx, v_ctx, scale=scale)
    o1, lse1 = o1.reshape(1, num_heads, n, head_dim), lse1.reshape(1, num_heads, n, 1)
    k_own = k_own.repeat_interleave(group, dim=1)
    v_own = v_own.repeat_interleave(group, dim=1)
    o2, lse2 = _flash_with_lse(q, k_own, v_own, is_causal=True, scale=scale)
    return _merge(o1, lse1, o2, lse2.unsqueeze(-1), q.dtype)


def _cascade_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, c: CascadeGroup, workspace: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, d] of the group's members -> [B, H, d]: shared prefix once, own suffixes, exact merge (float32).

    The prefix is one attention with the queries of every member as rows of their kv head ([KVH, B*g, d] against
    [KVH, Lp, d]: real GEMMs, K/V gathered once); the suffixes are one padded, masked batched attention. Each
    part yields its output and the logsumexp of its scores; out = sum_i o_i * exp(lse_i - logaddexp(lse_1, lse_2)).
    """
    if _flash_with_lse is None or q.device.type != "cpu":
        return _cascade_attention_reference(q, kv_layer, c, workspace, scale)
    b, num_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1]
    group = num_heads // kv_heads

    prefix = _gather(kv_layer, c.prefix_slots, workspace)  # [2, KVH, Lp, d]
    qp = q.view(b, kv_heads, group, head_dim).transpose(0, 1).reshape(1, kv_heads, b * group, head_dim)
    o1, lse1 = _flash_with_lse(qp, prefix[0].unsqueeze(0), prefix[1].unsqueeze(0), scale=scale)
    o1 = o1.reshape(kv_heads, b, group, head_dim).transpose(0, 1)  # [B, KVH, g, d]
    lse1 = lse1.reshape(kv_heads, b, group, 1).transpose(0, 1)

    suffix = _gather(kv_layer, c.suffix_slots, workspace).view(2, kv_heads, b, c.suffix_len, head_dim)
    o2, lse2 = _flash_with_lse(
        q.view(b, kv_heads, group, head_dim), suffix[0].transpose(0, 1), suffix[1].transpose(0, 1),
        attn_mask=c.suffix_mask, scale=scale,
    )
    lse2 = lse2.unsqueeze(-1)  # [B, KVH, g, 1]

    return _merge(o1, lse1, o2, lse2, q.dtype).reshape(b, num_heads, head_dim)


def _cascade_attention_reference(
    q: torch.Tensor, kv_layer: torch.Tensor, c: CascadeGroup, workspace: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same with plain float32 ops (unnormalised softmax pieces: max m, sum l, output o); any device."""
    b, num_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[1]
    group = num_heads // kv_heads
    qf = q.view(b, kv_heads, group, head_dim).float() * scale  # [B, KVH, g, d]

    prefix = _gather(kv_layer, c.prefix_slots, workspace).float()  # [2, KVH, Lp, d] (a copy unless fp32)
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

    suffix = _gather(kv_layer, c.suffix_slots, workspace).view(2, kv_heads, b, c.suffix_len, head_dim)
    ks = suffix[0].transpose(0, 1).float()  # [B, KVH, S, d]
    vs = suffix[1].transpose(0, 1).float()
    s2 = torch.matmul(qf, ks.transpose(-1, -2)).add_(c.suffix_mask)  # [B, KVH, g, S]
    m2 = s2.amax(-1, keepdim=True)
    p2 = s2.sub_(m2).exp_()
    l2 = p2.sum(-1, keepdim=True)
    o2 = torch.matmul(p2, vs)  # [B, KVH, g, d]

    m = torch.maximum(m1, m2)
    a1, a2 = (m1 - m).exp_(), (m2 - m).exp_()
    out = (o1 * a1).add_(o2 * a2).div_((l1 * a1).add_(l2 * a2))
    return out.to(q.dtype).reshape(b, num_heads, head_dim)
