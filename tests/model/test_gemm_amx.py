"""The AMX matrix product (csrc/gemm/gemm_amx.cpp; matmul path "amx"): its kernels on emulated tiles everywhere, on
the hardware where the CPU has AMX.

The emulated tiles (csrc/amx.h) compute what tdpbf16ps and the tile loads and stores compute, so the kernels'
layout, blocking and tails (16- and 32-row steps, a zero-padded row tail, K that is not a whole tile) are checked
on every AVX512_BF16 machine; the hardware's own rounding and the OS's tile permission only on an AMX one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import amx_selftest, native
from tests import kernels

SHAPES = {"qkv": (960, 576), "down": (576, 1536), "column_tail": (130, 64), "k_not_a_tile": (72, 40)}


def _case(n: int, k: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    return weight, native.gemm().gemm_pack(weight), torch.randn(rows, k, generator=gen).to(torch.bfloat16)


@kernels.GEMM
@pytest.mark.parametrize("name", list(SHAPES))
def test_emulated_tiles_rows_do_not_depend_on_the_batch(name):
    """Row counts around the 16-row step, the 32-row step and their tails, at any offset, one thread or two."""
    n, k = SHAPES[name]
    weight, packed, x = _case(n, k, 70, n)
    kernel = native.module().amx_gemm_emulated
    full = kernel(x, packed, n)
    for first, m in ((0, 1), (69, 1), (3, 15), (0, 16), (1, 17), (5, 32), (30, 33), (2, 50)):
        assert torch.equal(kernel(x[first : first + m].clone(), packed, n), full[first : first + m]), (first, m)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(x[:40], packed, n), full[:40])
    finally:
        torch.set_num_threads(threads)


@kernels.GEMM
def test_emulated_tiles_are_accurate_and_k_tails_take_the_avx512_chains():
    n, k = SHAPES["qkv"]
    weight, packed, x = _case(n, k, 40, 1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = native.module().amx_gemm_emulated(x, packed, n, bias).float()
    want = F.linear(x.float(), weight.float(), bias.float())
    assert torch.allclose(got, want, rtol=2**-8, atol=1e-5 * k)
    assert native.module().amx_gemm_emulated(x[:0], packed, n).shape == (0, n)
    n, k = SHAPES["k_not_a_tile"]  # K = 40: no whole 32-value tile, so gemm.cpp's chains, bit for bit
    weight, packed, x = _case(n, k, 40, 3)
    assert torch.equal(native.module().amx_gemm_emulated(x, packed, n), native.gemm().gemm(x, packed, n))


@kernels.GEMM
def test_the_self_test_passes_the_emulated_kernel():
    """The checks the hardware kernel must pass before the "amx" path is offered (amx_selftest), run here on the
    emulated kernel: the self-test's own logic is exercised on every machine."""
    assert amx_selftest.check(native.module(), native.module().amx_gemm_emulated) is None
    broken = lambda x, packed, n: native.module().amx_gemm_emulated(x, packed, n) * 1.01
    assert "differs from emulated tiles" in amx_selftest.check(native.module(), broken)


@kernels.GEMM
def test_without_amx_the_hardware_kernel_refuses_and_the_path_is_not_offered():
    if native.module().has_amx():
        pytest.skip("this CPU has AMX tiles")
    assert native.amx_gemm() is None
    weight, packed, x = _case(64, 32, 2, 4)
    with pytest.raises(RuntimeError, match="does not offer AMX tiles"):
        native.module().amx_gemm(x, packed, 64)


@kernels.AMX
def test_the_hardware_kernel_passes_its_self_test_and_is_offered():
    assert amx_selftest.check(native.module()) is None
    assert native.amx_verdict(native.build_directory(), "gemm") == "ok"
    assert native.amx_gemm() is not None
