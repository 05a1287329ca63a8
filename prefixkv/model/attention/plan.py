"""The step planner: a batch's rows -> row groups (groups.py), once per step; `paged_attention` runs them per layer.

Rows of a step come ordered decodes first (one token each, shortest context first), then prefill chunks (see
ModelRunner.execute). The planner reads only that batch and the frozen KernelOptions:
- decodes behind the same leading pages form cascade groups (options.cascade_decodes), read in place by the native
  kernels where options.native_attention is set;
- the other decodes are one in-place group (options.in_place_decodes), or padded length groups, split where
  padding would more than double the work;
- prefill chunks behind the same cached leading pages form shared-prefix groups (options.shared_prefill);
- with options.cache_invariant, a cascade or shared-prefix group's prefix is cut to a multiple of 64 keys (the
  native kernels' softmax chunk), where the handed-over state equals one pass's;
- every other prefill chunk is one group: native (options.native_attention), fresh, after cached tokens in one
  masked call, or split (options.split_prefill).
Everything index-shaped (slots, page tables, masks) is computed here, once, and read by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from prefixkv.model.attention.groups import (
    NATIVE_AMX,
    NATIVE_VECTOR,
    CascadeDecodes,
    InPlaceDecodes,
    NativeCascadeDecodes,
    NativeChunk,
    PaddedDecodes,
    PoolRange,
    PrefillChunk,
    RowGroup,
    Rows,
    SharedPrefixChunks,
    SplitChunk,
)
from prefixkv.model.options import KernelOptions

INVARIANT_ALIGN = 64  # keys per softmax chunk of the native kernels (csrc/attention/flash_attention.cpp kChunk)


@dataclass(slots=True)
class StepPlan:
    """Everything the attention layers need for one step; built once, read by every layer."""

    slot_mapping: torch.Tensor  # [T] slot where each row's new K/V goes
    groups: list[RowGroup]  # together they answer for every row of the step exactly once
    workspace: torch.Tensor  # flat scratch for gathered K/V, reused by every layer (no per-layer allocation)

    def groups_of(self, kind: type) -> list:
        return [g for g in self.groups if isinstance(g, kind)]

    def only_invariant_decodes(self) -> InPlaceDecodes | None:
        """The step's one group when every row is a decode attended in place by the cache-invariant kernel, in
        order (what the fused decode path computes), else None."""
        if len(self.groups) != 1:
            return None
        group = self.groups[0]
        if isinstance(group, InPlaceDecodes) and group.invariant and isinstance(group.rows, slice):
            return group
        return None


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, kv_layer: torch.Tensor, plan: StepPlan, scale: float
) -> torch.Tensor:
    """q [T, H, d], kv [T, 2, KVH, d] (new keys and values), kv_layer [2, KVH, slots, d] (this layer's pool).

    Writes the new K/V into their slots, then lets each row group attend; returns [T, H, d].
    """
    kv_layer.index_copy_(2, plan.slot_mapping, kv.permute(1, 2, 0, 3))
    groups = plan.groups
    if len(groups) == 1 and isinstance(groups[0].rows, slice):  # one group answers for all rows, in order
        return groups[0].attend(q, kv, kv_layer, plan.workspace, scale)
    out = q.new_empty(q.shape)
    for group in groups:
        o = group.attend(q, kv, kv_layer, plan.workspace, scale)
        if isinstance(group.rows, slice):
            out[group.rows] = o
        else:
            out.index_copy_(0, group.rows, o)
    return out


class StepPlanner:
    """Turns each step's batch into a StepPlan under fixed options; owns the gather workspace across steps."""

    def __init__(
        self,
        options: KernelOptions,
        page_size: int,
        dtype: torch.dtype,
        gather_width: int,
        device: torch.device | str = "cpu",
        pad_page: int = 0,
    ) -> None:
        """gather_width: elements per gathered slot (2 * kv_heads * head_dim); pad_page: the pool page that padded
        rows and page tables point at, which must stay finite (ModelRunner reserves one past the cache's pages, so
        a pool filled with NaN for debugging (debug_nan_kv) still pads with zeros)."""
        self.options = options
        self.page_size = page_size
        self.pad_page = pad_page
        self.dtype = dtype
        self.gather_width = gather_width
        self.device = torch.device(device)
        self._workspace: torch.Tensor | None = None  # kept across steps: fresh large allocations are slow on CPU

    def plan(self, token_counts: list[int], start_positions: list[int], page_tables: list[list[int]]) -> StepPlan:
        """Items must already be ordered 1-token items first, by ascending start_pos (see ModelRunner)."""
        num_decodes = 0
        while num_decodes < len(token_counts) and token_counts[num_decodes] == 1:
            num_decodes += 1
        groups = self._decode_groups(num_decodes, start_positions, page_tables)
        slot_parts = [
            np.asarray(
                [_slot(page_tables[i], start_positions[i], self.page_size) for i in range(num_decodes)], dtype=np.int64
            )
        ]
        row = num_decodes
        chunks: dict[int, tuple[slice, np.ndarray]] = {}  # chunk index -> (its rows, slots of [0, start + n))
        for i in range(num_decodes, len(token_counts)):
            n, start = token_counts[i], start_positions[i]
            slots = _slots(page_tables[i], start + n, self.page_size)
            slot_parts.append(slots[start:])
            chunks[i] = (slice(row, row + n), slots)
            row += n
        groups += self._prefill_groups(chunks, start_positions, page_tables)
        slot_mapping = torch.from_numpy(np.concatenate(slot_parts)).to(self.device)
        return StepPlan(slot_mapping, groups, self._workspace_for(groups))

    # -- decodes -----------------------------------------------------------------------------------------------
    def _decode_groups(self, num_decodes, start_positions, page_tables) -> list[RowGroup]:
        groups: list[RowGroup] = []
        rest = list(range(num_decodes))  # decodes left beside the cascade groups (ascending start_pos)
        if self.options.cascade_decodes and num_decodes >= 2:
            taken: set[int] = set()
            for members, prefix_pages in _cascade_members(
                rest,
                start_positions,
                page_tables,
                self.page_size,
                self.options,
                self.options.cascade_max_gather,
                self.options.cascade_min_members,
            ):
                groups.append(self._cascade_group(members, prefix_pages, start_positions, page_tables))
                taken.update(members)
            rest = [i for i in rest if i not in taken]
        if not rest:
            return groups
        if self.options.in_place_decodes:
            groups.append(self._in_place_group(rest, start_positions, page_tables))
        else:
            groups += [
                self._padded_group(members, start_positions, page_tables)
                for members in _length_groups(rest, start_positions, self.options)
            ]
        return groups

    def _rows(self, members: list[int]) -> Rows:
        """A slice when the members are adjacent rows in order (no index_select needed), else their indices."""
        if members == list(range(members[0], members[0] + len(members))):
            return slice(members[0], members[0] + len(members))
        return torch.tensor(members, dtype=torch.long, device=self.device)

    def _in_place_group(self, members, start_positions, page_tables) -> InPlaceDecodes:
        lens = np.asarray([start_positions[i] + 1 for i in members], dtype=np.int64)
        table = _page_table(members, page_tables, lens, 0, self.page_size, self.pad_page)
        return InPlaceDecodes(
            self._rows(members),
            self._tensor(table),
            self._tensor(lens),
            self.page_size,
            self.options.cache_invariant,
            self._native_isa,
        )

    def _padded_group(self, members, start_positions, page_tables) -> PaddedDecodes:
        slots, valid = _padded_slots(members, 0, start_positions, page_tables, self.page_size, self.pad_page)
        b, max_len = slots.shape
        mask = torch.from_numpy(np.where(valid, 0.0, -np.inf).astype(np.float32))
        return PaddedDecodes(
            self._rows(members),
            max_len,
            torch.from_numpy(slots.reshape(-1)).to(self.device),
            mask.to(device=self.device, dtype=self.dtype).view(b, 1, 1, max_len),
        )

    def _cascade_group(self, members, prefix_pages, start_positions, page_tables) -> RowGroup:
        ps = self.page_size
        if self.options.native_attention:
            return self._native_cascade_group(members, prefix_pages, start_positions, page_tables)
        prefix_len = prefix_pages * ps
        prefix_slots = _slots(page_tables[members[0]], prefix_len, ps)
        slots, valid = _padded_slots(members, prefix_len, start_positions, page_tables, ps, self.pad_page)
        b, suffix_len = slots.shape
        mask = torch.from_numpy(np.where(valid, 0.0, -np.inf).astype(np.float32)).view(b, 1, 1, suffix_len)
        return CascadeDecodes(
            self._rows(members),
            prefix_len,
            torch.from_numpy(prefix_slots).to(self.device),
            suffix_len,
            torch.from_numpy(slots.reshape(-1)).to(self.device),
            mask.to(device=self.device, dtype=self.dtype),
            flash=self.options.flash_lse,
        )

    def _native_cascade_group(self, members, prefix_pages, start_positions, page_tables) -> NativeCascadeDecodes:
        ps = self.page_size
        prefix_len = prefix_pages * ps
        lens = np.asarray([start_positions[i] + 1 - prefix_len for i in members], dtype=np.int64)
        table = _page_table(members, page_tables, lens, prefix_pages, ps, self.pad_page)
        return NativeCascadeDecodes(
            self._rows(members),
            self._tensor(_slots(page_tables[members[0]], prefix_len, ps)),
            torch.full((len(members),), prefix_len - 1, dtype=torch.long, device=self.device),
            self._tensor(table),
            self._tensor(lens),
            ps,
            self.options.cache_invariant,
            self._native_isa,
        )

    # -- prefill chunks ----------------------------------------------------------------------------------------
    def _prefill_groups(self, chunks, start_positions, page_tables) -> list[RowGroup]:
        groups: list[RowGroup] = []
        if self.options.shared_prefill and len(chunks) >= 2:
            after_cache = [i for i in chunks if start_positions[i] > 0]
            for members, prefix_pages in _cascade_members(
                after_cache, start_positions, page_tables, self.page_size, self.options, max_gather=None
            ):
                groups.append(
                    self._shared_prefix_group(members, prefix_pages * self.page_size, chunks, start_positions)
                )
                for i in members:
                    del chunks[i]
        groups += [self._prefill_group(rows, start_positions[i], slots) for i, (rows, slots) in chunks.items()]
        return groups

    def _shared_prefix_group(self, members, prefix_len, chunks, start_positions) -> SharedPrefixChunks:
        row_ids: list[int] = []
        parts: list[tuple[slice, torch.Tensor, torch.Tensor]] = []
        offset = 0
        for i in members:
            rows, slots = chunks[i]
            n, start = rows.stop - rows.start, start_positions[i]
            row_ids.extend(range(rows.start, rows.stop))
            own_positions = np.arange(start - prefix_len, start - prefix_len + n, dtype=np.int64)
            parts.append((slice(offset, offset + n), self._tensor(slots[prefix_len:]), self._tensor(own_positions)))
            offset += n
        prefix_slots = chunks[members[0]][1][:prefix_len]
        return SharedPrefixChunks(
            self._rows(row_ids),
            self._tensor(prefix_slots),
            torch.full((offset,), prefix_len - 1, dtype=torch.long, device=self.device),
            parts,
            self.options.cache_invariant,
            self._native_isa,
        )

    @property
    def _native_isa(self) -> int:
        return NATIVE_AMX if self.options.amx_attention else NATIVE_VECTOR

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _prefill_group(self, rows: slice, start: int, slots: np.ndarray) -> RowGroup:
        """slots: those of positions [0, start + n) of the chunk's request."""
        if self.options.native_attention:
            positions = np.arange(start, start + rows.stop - rows.start, dtype=np.int64)
            return NativeChunk(rows, self._tensor(slots), self._tensor(positions), self._native_isa)
        if start == 0:  # no cached context: the chunk's own K/V suffice
            return PrefillChunk(rows, 0, None, None)
        if self.options.split_prefill:
            return SplitChunk(rows, start, self._pool_range(slots[:start]), flash=self.options.flash_lse)
        n = rows.stop - rows.start
        q_pos = np.arange(start, start + n)[:, None]
        mask = np.where(np.arange(start + n)[None, :] <= q_pos, 0.0, -np.inf).astype(np.float32)
        return PrefillChunk(
            rows, start, self._pool_range(slots), torch.from_numpy(mask).to(device=self.device, dtype=self.dtype)
        )

    def _pool_range(self, slots: np.ndarray) -> PoolRange:
        if slots[-1] - slots[0] == len(slots) - 1 and (np.diff(slots) == 1).all():
            return PoolRange(len(slots), int(slots[0]), None)
        return PoolRange(len(slots), None, torch.from_numpy(slots).to(self.device))

    def _workspace_for(self, groups: list[RowGroup]) -> torch.Tensor:
        need = max([0] + [g.workspace_slots for g in groups]) * self.gather_width
        if self._workspace is None or self._workspace.numel() < need:
            # headroom: fewer regrows
            self._workspace = torch.empty(max(need + need // 4, 1), dtype=self.dtype, device=self.device)
        return self._workspace


def _slot(page_table: list[int], pos: int, page_size: int) -> int:
    return page_table[pos // page_size] * page_size + pos % page_size


def _slots(page_table: list[int], end: int, page_size: int) -> np.ndarray:
    """Slots of positions [0, end)."""
    pt = np.asarray(page_table[: -(-end // page_size)], dtype=np.int64)
    pos = np.arange(end, dtype=np.int64)
    return pt[pos // page_size] * page_size + pos % page_size


def _page_table(members, page_tables, lens: np.ndarray, first_page: int, page_size: int, pad_page: int) -> np.ndarray:
    """[B, pages] the pages holding each member's positions [first_page * page_size, + lens[b]), padded with
    pad_page."""
    table = np.full((len(members), int(-(-lens.max() // page_size))), pad_page, dtype=np.int64)
    for b, i in enumerate(members):
        pages = page_tables[i][first_page : first_page + -(-int(lens[b]) // page_size)]
        table[b, : len(pages)] = pages
    return table


def _padded_slots(members, offset, start_positions, page_tables, page_size, pad_page):
    """Slots of positions [offset, start_pos + 1) of each member, padded to the longest with pad_page's first slot:
    (slots [B, L], valid). Masked out, but read: the pad must be finite (a NaN times a zero weight is NaN)."""
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
    return np.where(valid, slots, pad_page * page_size), valid


def _length_groups(members: list[int], start_positions, options: KernelOptions) -> list[list[int]]:
    """Split `members` (ascending start_pos) where padding to the group's longest would more than double work."""
    groups: list[list[int]] = []
    group_start = 0
    for k in range(len(members) + 1):
        length = start_positions[members[k]] + 1 if k < len(members) else 0
        if k == len(members) or (
            length > options.min_split_len
            and length > options.group_growth * (start_positions[members[group_start]] + 1)
        ):
            if k > group_start:
                groups.append(members[group_start:k])
            group_start = k
    return groups


def _cascade_members(
    candidates, start_positions, page_tables, page_size, options: KernelOptions, max_gather, min_members: int = 2
):
    """[(members, shared_pages)]: >= min_members rows whose page tables share >= options.cascade_min_prefix leading
    tokens.

    Candidates are decodes, or prefill chunks after cached tokens (their start positions are then their first new
    positions). Only pages lying entirely before every member's start position count (the current token's slot
    is written this step), and only groups that gather at most max_gather of the slots their members would
    gather alone (None: no such check, for chunks, which gather nothing). Members are grouped by their first
    page; when a group's common prefix is too short, it is split by the first page where its members diverge
    (so two big families behind one short shared start are both found).
    """
    min_pages = -(-options.cascade_min_prefix // page_size)
    # cache-invariant groups hand softmax state over at the prefix's end: it must fall on the kernel's 64-key chunks
    align = math.lcm(INVARIANT_ALIGN, page_size) // page_size if options.cache_invariant else 1
    found = []

    def split(members: list[int], depth: int) -> None:
        # members share pages [0, depth); each candidate has at least min_pages full pages before its position
        by_page: dict[int, list[int]] = {}
        for i in members:
            by_page.setdefault(page_tables[i][depth], []).append(i)
        for sub in by_page.values():
            if len(sub) < min_members:
                continue
            limit = min(start_positions[i] for i in sub) // page_size  # pages wholly before every position
            table = np.asarray([page_tables[i][:limit] for i in sub], dtype=np.int64)
            same = (table == table[0]).all(axis=0)
            shared = limit if same.all() else int(np.argmin(same))
            usable = shared - shared % align
            if usable >= min_pages:
                ends = [start_positions[i] + 1 for i in sub]
                cascade_slots = usable * page_size * (1 - len(sub)) + len(sub) * max(ends)
                if max_gather is None or cascade_slots <= max_gather * sum(ends):
                    found.append((sub, usable))
            elif shared < limit:
                split(sub, shared)

    split([i for i in candidates if start_positions[i] // page_size >= min_pages], 0)
    return found
