"""The AMX kernels' checks on this machine, one per kernel family, each run once per native build in a subprocess.

Why a subprocess: AMX needs the OS to grant the tile state and a correct tile configuration; a kernel that gets
either wrong faults (SIGSEGV, SIGILL) instead of raising, and that must not take an engine down. Why one check per
family: the matrix product (csrc/gemm/gemm_amx.cpp, matmul "amx") and attention (isa 1 of
csrc/attention/flash_attention.cpp: prefill, paged decode and the fused decode loop) are separate code, so each is
offered only on its own verdict (native.amx_gemm, native.amx_attention); a fault in one cannot vouch for or against
the other.

Each check holds the hardware kernels to what cache-invariant bf16 relies on:
- accuracy: they agree with the same kernels on emulated tiles (csrc/amx.h) and with the vector path (AVX512_BF16)
  to within bf16 rounding;
- invariance, bit for bit: a matrix-product row is the same in any batch; an attention row is the same in a call of
  its own chunk as inside a long one, a decode is that row of a prefill, and attention over keys [0, P) handing its
  state to [P, L) equals one pass (prefill and decode), around the kernels' 16-row tiles and 64-key chunks.

`python -m prefixkv.model.amx_selftest gemm|attention` prints "ok" (exit status 0) or what failed; `--isa 2` checks
the emulated tiles in place of the hardware and `--kernels module:function` another attention kernel (the tests'
way to show that a wrong kernel fails and is not offered, on any AVX512_BF16 machine).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

ISA_VECTOR, ISA_AMX, ISA_EMULATED = 0, 1, 2  # the attention kernels' isa argument

SHAPES = ((960, 576), (576, 1536), (130, 64), (72, 40))  # qkv, down, a column tail, K not a whole tile
ROWS = (1, 5, 16, 17, 33, 70)

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2's attention shape (native_attention's)
SCALE = HEAD_DIM**-0.5
POOL_SLOTS = 2048


class AttentionKernels(NamedTuple):
    """The two attention entry points under test, with csrc/attention/flash_attention.cpp's signatures minus `isa`."""

    prefill: Callable  # flash_attention(q, kv, slots, q_pos, scale, state_in=None, return_state=False)
    decode: Callable  # paged_flash_decode(q, kv, table, lens, page_size, scale, state_in=None, return_state=False)


def attention_kernels(module, isa: int) -> AttentionKernels:
    return AttentionKernels(
        functools.partial(module.flash_attention, isa=isa), functools.partial(module.paged_flash_decode, isa=isa)
    )


def check(module, kernel=None) -> str | None:
    """None when the matrix product `kernel` (default: the hardware module.amx_gemm) passes, else what failed."""
    if kernel is None:
        if not module.has_amx():
            return "the CPU or the OS does not offer AMX tiles (cpuid / arch_prctl)"
        kernel = module.amx_gemm
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        packed = module.gemm_pack(weight)
        x = torch.randn(max(ROWS), k, generator=gen).to(torch.bfloat16)
        full = kernel(x, packed, n)
        for name, other in (("emulated tiles", module.amx_gemm_emulated), ("AVX512_BF16", module.gemm)):
            want = other(x, packed, n).float()
            # two bf16 roundings apart at most, plus float32 sums in another order
            if not torch.allclose(full.float(), want, rtol=2**-7, atol=1e-4 * k):
                return f"[{n}, {k}]: differs from {name} by {(full.float() - want).abs().max().item():.3g}"
        for m in ROWS:
            for first in (0, max(ROWS) - m):
                part = kernel(x[first : first + m].clone(), packed, n)
                if not torch.equal(part, full[first : first + m]):
                    return (
                        f"[{n}, {k}]: rows [{first}, {first + m}) differ from the same rows in a {max(ROWS)}-row call"
                    )
    return None


def check_attention(module, kernels: AttentionKernels | None = None) -> str | None:
    """None when attention `kernels` (default: the hardware tiles, isa 1) pass, else what failed."""
    if kernels is None:
        if not module.has_amx():
            return "the CPU or the OS does not offer AMX tiles (cpuid / arch_prctl)"
        kernels = attention_kernels(module, ISA_AMX)
    references = {
        "emulated tiles": attention_kernels(module, ISA_EMULATED),
        "AVX512_BF16": attention_kernels(module, ISA_VECTOR),
    }
    for failure in (
        _attention_accuracy(kernels, references),
        _rows_do_not_depend_on_their_chunk(kernels),
        _decodes_equal_prefill_rows(kernels),
        _state_handover_equals_one_pass(kernels),
    ):
        if failure is not None:
            return failure
    return None


def _pool(seed: int) -> tuple[torch.Generator, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return gen, torch.randn(2, KV_HEADS, POOL_SLOTS, HEAD_DIM, generator=gen).to(torch.bfloat16)


def _queries(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(torch.bfloat16)


def _paged(gen: torch.Generator, lengths: list[int], page_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zero-padded page table of shuffled, disjoint pages per sequence, and each sequence's slots in order."""
    order = torch.randperm(POOL_SLOTS // page_size, generator=gen).tolist()
    tables, slots = [], []
    for n in lengths:
        pages, order = order[: -(-n // page_size)], order[-(-n // page_size) :]
        tables.append(pages)
        pos = torch.arange(n)
        slots.append(torch.tensor(pages)[pos // page_size] * page_size + pos % page_size)
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), slots


def _attention_accuracy(kernels: AttentionKernels, references: dict[str, AttentionKernels]) -> str | None:
    gen, pool = _pool(11)
    length = 200
    slots = torch.randperm(POOL_SLOTS, generator=gen)[:length]
    q = _queries(gen, length)
    out, lse = kernels.prefill(q, pool, slots, torch.arange(length), SCALE)
    lens = [1, 17, 65, 300]
    table, _ = _paged(gen, lens, 16)
    dq = _queries(gen, len(lens))
    dout, dlse = kernels.decode(dq, pool, table, torch.tensor(lens), 16, SCALE)
    for name, ref in references.items():
        want, want_lse = ref.prefill(q, pool, slots, torch.arange(length), SCALE)
        dwant, dwant_lse = ref.decode(dq, pool, table, torch.tensor(lens), 16, SCALE)
        for what, got, expect, got_lse, expect_lse in (
            ("prefill", out, want, lse, want_lse),
            ("decode", dout, dwant, dlse, dwant_lse),
        ):
            # bf16's own rounding of the output apart at most; the log-sum-exp in float32
            if not torch.allclose(got.float(), expect.float(), rtol=2**-7, atol=2**-8):
                error = (got.float() - expect.float()).abs().max().item()
                return f"attention {what}: differs from {name} by {error:.3g}"
            if not torch.allclose(got_lse, expect_lse, atol=1e-4):
                error = (got_lse - expect_lse).abs().max().item()
                return f"attention {what}: log-sum-exp differs from {name} by {error:.3g}"
    return None


def _rows_do_not_depend_on_their_chunk(kernels: AttentionKernels) -> str | None:
    for length, first, n in ((300, 0, 300), (300, 137, 1), (300, 64, 100), (300, 15, 18), (1000, 999, 1)):
        gen, pool = _pool(length + first)
        slots = torch.randperm(POOL_SLOTS, generator=gen)[:length]
        q = _queries(gen, length)
        whole, whole_lse = kernels.prefill(q, pool, slots, torch.arange(length), SCALE)
        part, part_lse = kernels.prefill(
            q[first : first + n], pool, slots[: first + n], torch.arange(first, first + n), SCALE
        )
        if not (torch.equal(part, whole[first : first + n]) and torch.equal(part_lse, whole_lse[first : first + n])):
            return f"attention rows [{first}, {first + n}) differ from the same rows of a {length}-row call"
    return None


def _decodes_equal_prefill_rows(kernels: AttentionKernels) -> str | None:
    for page_size in (1, 16):
        gen, pool = _pool(page_size)
        lens = [1, 2, 15, 16, 17, 63, 64, 65, 129, 500]
        table, slots = _paged(gen, lens, page_size)
        q = _queries(gen, len(lens))
        out, lse = kernels.decode(q, pool, table, torch.tensor(lens), page_size, SCALE)
        for b, n in enumerate(lens):
            want, want_lse = kernels.prefill(q[b : b + 1], pool, slots[b], torch.tensor([n - 1]), SCALE)
            if not (torch.equal(out[b], want[0]) and torch.equal(lse[b], want_lse[0])):
                return f"attention: a decode over {n} keys (pages of {page_size}) differs from that row of a prefill"
    return None


def _state_handover_equals_one_pass(kernels: AttentionKernels) -> str | None:
    for prefix in (64, 512):
        gen, pool = _pool(prefix)
        length, n = prefix + 90, 40
        slots = torch.randperm(POOL_SLOTS, generator=gen)[:length]
        q = _queries(gen, n)
        q_pos = torch.arange(length - n, length)
        whole, whole_lse = kernels.prefill(q, pool, slots, q_pos, SCALE)
        _, _, state = kernels.prefill(q, pool, slots[:prefix], torch.full((n,), prefix - 1), SCALE, return_state=True)
        out, lse = kernels.prefill(q, pool, slots[prefix:], q_pos - prefix, SCALE, state)
        if not (torch.equal(out, whole) and torch.equal(lse, whole_lse)):
            return f"attention: keys [0, {prefix}) handing their state to the rest differ from one prefill pass"
    return _decode_state_handover_equals_one_pass(kernels)


def _decode_state_handover_equals_one_pass(kernels: AttentionKernels) -> str | None:
    """A shared prefix attended by the prefill kernel, each decode's own pages after it: == one decode pass."""
    page_size, prefix = 16, 128
    gen, pool = _pool(7)
    lens = [prefix + 1, prefix + 40, prefix + 200]
    table, slots = _paged(gen, [prefix, *(n - prefix for n in lens)], page_size)
    shared, own = table[0, : prefix // page_size], table[1:]
    table = torch.cat([shared.expand(len(lens), -1), own], dim=1)  # the prefix's pages, then each decode's own
    q = _queries(gen, len(lens))
    whole, whole_lse = kernels.decode(q, pool, table, torch.tensor(lens), page_size, SCALE)
    _, _, state = kernels.prefill(q, pool, slots[0], torch.full((len(lens),), prefix - 1), SCALE, return_state=True)
    suffix = table[:, prefix // page_size :].contiguous()
    out, lse = kernels.decode(q, pool, suffix, torch.tensor(lens) - prefix, page_size, SCALE, state)
    if not (torch.equal(out, whole) and torch.equal(lse, whole_lse)):
        return "attention: a shared prefix's state handed to each decode's own pages differs from one decode pass"
    return None


def _kernels_from(spec: str, module) -> AttentionKernels:
    """`module:function`, a function of the native module returning the AttentionKernels to check."""
    module_name, _, function = spec.partition(":")
    return getattr(importlib.import_module(module_name), function)(module)


def main(argv: list[str]) -> int:
    from prefixkv.model import native

    parser = argparse.ArgumentParser(prog="python -m prefixkv.model.amx_selftest")
    parser.add_argument("family", choices=native.AMX_FAMILIES)
    parser.add_argument("--isa", type=int, choices=(ISA_AMX, ISA_EMULATED), default=ISA_AMX)
    parser.add_argument("--kernels", help="module:function giving the attention kernels to check (tests)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    module = native.module()
    if module is None:
        print("the native kernels are not built")
        return 1
    if args.family == "gemm":
        failure = check(module, module.amx_gemm_emulated if args.isa == ISA_EMULATED else None)
    else:
        kernels = _kernels_from(args.kernels, module) if args.kernels else None
        if kernels is None and args.isa == ISA_EMULATED:
            kernels = attention_kernels(module, ISA_EMULATED)
        failure = check_attention(module, kernels)
    print(failure or "ok")
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
