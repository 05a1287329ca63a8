"""Paged attention over the KV pool: one plan per step (plan.py), one `attend` per row group (groups.py).

KV pool layout: one tensor [num_layers, 2 (k, v), num_kv_heads, num_slots, head_dim]. Slot of position p of a
request = page_table[p // page_size] * page_size + p % page_size. Keeping slots as the second-to-last axis
means that gathering a request's slots yields [kv_heads, L, head_dim] blocks that feed SDPA without a copy.

Which path runs is decided in two places only, and never per layer:
- once per runner, in KernelOptions (prefixkv/model/options.py): what this device, dtype and build can run;
- once per step, by StepPlanner.plan (plan.py): the step's rows split into row groups (in-place decodes, padded
  decodes, cascade decodes, native chunks, shared-prefix chunks, prefill chunks, split chunks), with every
  index-shaped tensor they need.
`paged_attention` then writes each layer's new K/V into the pool and lets every group attend (groups.py). Groups
that attend to two disjoint key sets and merge (cascade decodes, shared-prefix chunks, split chunks) share
merge.py; that reordering of the softmax sum is why the options enable them only below float32. In bf16 with
KernelOptions.cache_invariant (the default where the native kernels run) the native groups do not merge: the
shared prefix hands each row's softmax state to the row's own keys, and decodes use the prefill kernel's
arithmetic, so a token's result is the same cached or fresh, whatever the chunking or the batch. A new way to
attend is one more group class and one more rule in the planner.
"""

from prefixkv.model.attention.groups import (
    CascadeDecodes,
    InPlaceDecodes,
    NativeCascadeDecodes,
    NativeChunk,
    PaddedDecodes,
    PoolRange,
    PrefillChunk,
    RowGroup,
    SharedPrefixChunks,
    SplitChunk,
)
from prefixkv.model.attention.plan import StepPlan, StepPlanner, paged_attention

__all__ = [
    "CascadeDecodes",
    "InPlaceDecodes",
    "NativeCascadeDecodes",
    "NativeChunk",
    "PaddedDecodes",
    "PoolRange",
    "PrefillChunk",
    "RowGroup",
    "SharedPrefixChunks",
    "SplitChunk",
    "StepPlan",
    "StepPlanner",
    "paged_attention",
]
