"""Cache-invariant bf16 building blocks, bit for bit (issue: the same answer warm or cold).

A token's attention output must not depend on how its context reached the pool or how the step was cut:
- a row computed inside a long call == the same row in a call of its own chunk (chunk boundaries anywhere);
- a decode (paged_flash_decode, own pages, any page size, shuffled page tables) == that row of flash_attention;
- attention over keys [0, P) handing its state to [P, L) == one pass over [0, L), for P a multiple of 64
  (how shared prefixes are attended once), for both kernels;
(the matrix products' row invariance is tests/model/test_gemm.py's).
Each holds for every way the kernels compute their products (`isa`): the vector path (AVX512_BF16 dot products,
or float32 FMAs on a CPU without AVX-512 BF16) and AMX tiles, the latter in AVX-512 builds on emulated tiles
(csrc/amx.h) and on the hardware where the CPU has AMX (only there are those cases generated); and the kernel-level
ones also on the AVX2 variant of the build (tests/model/native_builds.py), so the AVX2 kernels are checked on
AVX-512 CPUs too.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prefixkv.model import cpu_features, native
from prefixkv.model.attention import NativeCascadeDecodes, SharedPrefixChunks, StepPlanner, paged_attention
from prefixkv.model.options import KernelOptions
from tests import kernels
from tests.model.helpers import PagePool, shared_prefix_step
from tests.model.native_builds import AVX2, MAIN, module

pytestmark = kernels.NATIVE_ATTENTION

KVH, GROUP, D = 3, 3, 64
SCALE = D**-0.5
# each head_dim the kernels are built for (csrc/attention/flash_attention*.cpp): every kernel-level
# invariance below holds for both
DIMS = [pytest.param(64, id="d64"), pytest.param(128, id="d128")]
# the kernels' isa argument. 0: the build's vector products, AVX512_BF16 dot products where the CPU has them, else
# float32 FMAs (AVX2). The AMX kernels are in the AVX-512 build only: on emulated tiles on every CPU with
# AVX512_BF16, on the hardware tiles only on a CPU that has them (where the CPU has AMX and the build lacks the
# kernels, kernels.AMX fails the case)
AVX512_BUILD = cpu_features.has(cpu_features.AVX512_BF16)
# Each case is (build, isa): the main build's isas, then the AVX2 variant's vector path ("avx2_build")
if AVX512_BUILD:
    AMX_ISAS = [pytest.param(MAIN, 2, id="amx_emulated")]
    if cpu_features.has(cpu_features.AMX_BF16):
        AMX_ISAS.insert(0, pytest.param(MAIN, 1, id="amx", marks=kernels.AMX))
else:
    reason = f"the AMX kernels are built with AVX512_BF16, which this CPU ({cpu_features.model_name()}) lacks"
    AMX_ISAS = [pytest.param(MAIN, 2, id="amx_emulated", marks=pytest.mark.skip(reason=reason))]
ISAS = [
    pytest.param(MAIN, 0, id="avx512_bf16" if AVX512_BUILD else "avx2"),
    *AMX_ISAS,
    pytest.param(AVX2, 0, id="avx2_build"),
]


def _pool(seed: int, num_slots: int = 2048, d: int = D) -> tuple[torch.Generator, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return gen, torch.randn(2, KVH, num_slots, d, generator=gen).to(torch.bfloat16)


def _q(gen, rows: int, d: int = D) -> torch.Tensor:
    return torch.randn(rows, KVH * GROUP, d, generator=gen).to(torch.bfloat16)


def _paged(gen, length: int, page_size: int, num_slots: int) -> tuple[list[int], torch.Tensor]:
    """A shuffled page table covering `length` positions and the slot of each position."""
    pages = torch.randperm(num_slots // page_size, generator=gen)[: -(-length // page_size)].tolist()
    pos = torch.arange(length)
    slots = torch.tensor(pages)[pos // page_size] * page_size + pos % page_size
    return pages, slots


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("build, isa", ISAS)
@pytest.mark.parametrize("length, first, n", [(300, 0, 300), (300, 137, 1), (300, 64, 100), (1000, 999, 1)])
def test_a_row_does_not_depend_on_its_chunk(length, first, n, build, isa, d):
    """Rows [first, first + n) computed as their own chunk == the same rows of a call over the whole prompt."""
    gen, pool = _pool(length + first, d=d)
    slots = torch.randperm(pool.shape[2], generator=gen)[:length]
    q, scale = _q(gen, length, d), d**-0.5
    whole, whole_lse = module(build).flash_attention(q, pool, slots, torch.arange(length), scale, isa=isa)
    part, part_lse = module(build).flash_attention(
        q[first : first + n], pool, slots[: first + n], torch.arange(first, first + n), scale, isa=isa
    )
    assert torch.equal(part, whole[first : first + n])
    assert torch.equal(part_lse, whole_lse[first : first + n])


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("build, isa", ISAS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decodes_equal_the_prefill_kernel(page_size, build, isa, d):
    """Each decode of a batch (lengths around the 16- and 64-key blocks) == its row computed by flash_attention."""
    gen, pool = _pool(page_size, d=d)
    lens = [1, 2, 15, 16, 17, 63, 64, 65, 129, 500]
    q, scale = _q(gen, len(lens), d), d**-0.5
    tables, slot_lists = zip(*(_paged(gen, n, page_size, pool.shape[2]) for n in lens))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out, lse = module(build).paged_flash_decode(q, pool, table, torch.tensor(lens), page_size, scale, isa=isa)
    for b, (n, slots) in enumerate(zip(lens, slot_lists)):
        want, want_lse = module(build).flash_attention(q[b : b + 1], pool, slots, torch.tensor([n - 1]), scale, isa=isa)
        assert torch.equal(out[b], want[0]), f"length {n}"
        assert torch.equal(lse[b], want_lse[0])


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("build, isa", ISAS)
@pytest.mark.parametrize("prefix", [64, 128, 512])
def test_state_handover_equals_one_pass(prefix, build, isa, d):
    """Keys [0, prefix) then the rest from the handed-over state == one call over all keys (prefill rows)."""
    gen, pool = _pool(prefix, d=d)
    length, n = prefix + 90, 40
    slots = torch.randperm(pool.shape[2], generator=gen)[:length]
    q, scale = _q(gen, n, d), d**-0.5
    q_pos = torch.arange(length - n, length)
    kernel = functools.partial(module(build).flash_attention, isa=isa)
    whole, whole_lse = kernel(q, pool, slots, q_pos, scale)
    _, _, state = kernel(q, pool, slots[:prefix], torch.full((n,), prefix - 1), scale, return_state=True)
    out, lse = kernel(q, pool, slots[prefix:], q_pos - prefix, scale, state)
    assert torch.equal(out, whole)
    assert torch.equal(lse, whole_lse)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("build, isa", ISAS)
def test_decode_state_handover_equals_one_pass(build, isa, d):
    """A shared prefix attended by flash_attention, each decode's own pages after it: == one decode pass."""
    page_size, prefix = 16, 128
    gen, pool = _pool(7, d=d)
    lens = [prefix + 1, prefix + 40, prefix + 200]
    q, scale = _q(gen, len(lens), d), d**-0.5
    shared_pages, _ = _paged(gen, prefix, page_size, pool.shape[2])
    used = set(shared_pages)
    free = [p for p in torch.randperm(pool.shape[2] // page_size, generator=gen).tolist() if p not in used]
    tables = []
    for n in lens:
        own = -(-(n - prefix) // page_size)
        tables.append(shared_pages + free[:own])
        free = free[own:]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    kernels = module(build)
    whole, whole_lse = kernels.paged_flash_decode(q, pool, table, torch.tensor(lens), page_size, scale, isa=isa)
    prefix_slots = (torch.tensor(shared_pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    _, _, state = kernels.flash_attention(
        q, pool, prefix_slots, torch.full((len(lens),), prefix - 1), scale, return_state=True, isa=isa
    )
    suffix_table = table[:, prefix // page_size :].contiguous()
    out, lse = kernels.paged_flash_decode(
        q, pool, suffix_table, torch.tensor(lens) - prefix, page_size, scale, state, isa=isa
    )
    assert torch.equal(out, whole)
    assert torch.equal(lse, whole_lse)


@pytest.mark.parametrize("page_size", [16, 1])
def test_shared_prefix_groups_equal_every_row_alone(page_size):
    """A step with shared-prefix chunks (and cascade decodes where they pay) behind a 96-token prefix, cut to 64
    for the handover, gives bit for bit what the same step gives with each row attending over its whole context
    by itself."""
    counts, starts, tables = shared_prefix_step(page_size)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(2, KVH, 2048, D, generator=gen).to(torch.bfloat16)
    t = sum(counts)
    q, kv = _q(gen, t), torch.randn(t, 2, KVH, D, generator=gen).to(torch.bfloat16)
    alone = KernelOptions(in_place_decodes=True, native_attention=True, cache_invariant=True)
    grouped = KernelOptions(
        in_place_decodes=True, cascade_decodes=True, native_attention=True, shared_prefill=True, cache_invariant=True
    )
    outs = []
    for options in (alone, grouped):
        plan = StepPlanner(options, page_size, torch.bfloat16, 2 * KVH * D).plan(counts, starts, tables)
        outs.append(paged_attention(q, kv, pool.clone(), plan, SCALE))
    (shared,) = plan.groups_of(SharedPrefixChunks)
    assert len(shared.prefix_slots) == 64
    assert all(len(c.prefix_slots) == 64 for c in plan.groups_of(NativeCascadeDecodes))
    assert torch.equal(outs[1], outs[0])


def test_cascade_decodes_equal_each_decode_alone():
    """Decodes behind a 200-token shared prefix form a cascade group (prefix cut to 192): == each decode alone."""
    page_size = 16
    pool_pages = PagePool(2048 // page_size, shuffle_seed=5)
    shared = pool_pages.take(13)  # positions [0, 208)
    starts = [250, 300, 310]
    tables = [shared + pool_pages.take(-(-(s + 1) // page_size) - 13) for s in starts]
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(2, KVH, 2048, D, generator=gen).to(torch.bfloat16)
    q, kv = _q(gen, 3), torch.randn(3, 2, KVH, D, generator=gen).to(torch.bfloat16)
    outs = []
    for cascade in (False, True):
        options = KernelOptions(
            in_place_decodes=True, cascade_decodes=cascade, native_attention=True, cache_invariant=True
        )
        plan = StepPlanner(options, page_size, torch.bfloat16, 2 * KVH * D).plan([1, 1, 1], starts, tables)
        outs.append(paged_attention(q, kv, pool.clone(), plan, SCALE))
    (group,) = plan.groups_of(NativeCascadeDecodes)
    assert len(group.prefix_slots) == 192
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("build, isa", AMX_ISAS)
def test_amx_products_are_as_accurate_as_the_avx512_ones(build, isa, d):
    """The AMX path rounds differently from the AVX-512 one (another order of the same float32 sums), by no more
    than bf16's own rounding of the output."""
    gen, pool = _pool(11, d=d)
    length = 200
    slots = torch.randperm(pool.shape[2], generator=gen)[:length]
    q, scale = _q(gen, length, d), d**-0.5
    avx, avx_lse = module(build).flash_attention(q, pool, slots, torch.arange(length), scale)
    amx, amx_lse = module(build).flash_attention(q, pool, slots, torch.arange(length), scale, isa=isa)
    assert torch.allclose(amx.float(), avx.float(), rtol=2**-7, atol=2**-8)
    # the lse: as close to a float64 reference as the AVX-512 path's (the scores sum in another order, which can
    # flip a probability's bf16 rounding: at head_dim 128 the two paths differ by up to 9e-4, each ~1e-3 from it)
    k = pool[0][:, slots].double().repeat_interleave(GROUP, 0)
    scores = torch.einsum("rhd,hld->hrl", q.double(), k) * scale
    scores = scores.masked_fill(torch.arange(length)[None, :] > torch.arange(length)[:, None], float("-inf"))
    want = torch.logsumexp(scores, -1).transpose(0, 1)
    avx_error, amx_error = ((lse.double() - want).abs().max().item() for lse in (avx_lse, amx_lse))
    assert amx_error <= 1.5 * avx_error + 1e-4, (amx_error, avx_error)


def test_state_shape_is_checked():
    gen, pool = _pool(3)
    q = _q(gen, 2)
    with pytest.raises(RuntimeError, match="state must be"):
        native.module().flash_attention(
            q, pool, torch.arange(8), torch.tensor([7, 7]), SCALE, torch.zeros(2, KVH * GROUP, 64)
        )
