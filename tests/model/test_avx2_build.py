"""The AVX2 variant of the native build (native.VARIANTS["avx2"], tests/model/native_builds.py) on any CPU that
runs AVX2 + FMA: it is the AVX2 build, it loads beside the main one, and its matrix products are row-invariant bit
for bit and accurate (bf16 gemm and the float32 gemm_f32, which only an AVX2 build has). Its attention kernels run
the invariance and accuracy tests of test_invariant_attention.py and test_native_attention.py ("avx2_build").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import native
from tests.model.native_builds import AVX2, module

# columns with a 64-column tail and one below 16, K not a multiple of 32: every tail of the kernels
SHAPES = {"qkv": (960, 576), "n130_k97": (130, 97), "n8_k33": (8, 33)}
SUB_BATCHES = ((0, 1), (7, 1), (99, 1), (0, 2), (3, 5), (10, 6), (1, 7), (5, 13), (33, 64))


@pytest.fixture(scope="module")
def avx2():
    return module(AVX2)


def test_it_is_the_avx2_build_beside_the_main_one(avx2):
    assert avx2.attention_isa() == "avx2" and avx2.gemm_isa() == "avx2"
    assert avx2.has_gemm_f32() and not avx2.has_fused_ops() and not avx2.has_amx()
    assert avx2.__name__ != native.module().__name__
    assert native.build_directory(AVX2) != native.build_directory() and native.is_built(native.build_directory(AVX2))
    q, pool = torch.zeros(1, 3, 64, dtype=torch.bfloat16), torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="isa 0 only"):  # the AMX kernels are in AVX-512 builds only
        avx2.flash_attention(q, pool, torch.arange(1), torch.zeros(1, dtype=torch.long), 1.0, isa=2)


def _one_thread(fn):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(SHAPES))
def test_bf16_rows_do_not_depend_on_the_batch(avx2, name):
    """Every sub-batch (around the 2-row tiles, the row blocks, the thread split) and one thread give the rows of
    the 100-row product bit for bit, within bf16 rounding of the float64 product."""
    n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    x, bias = torch.randn(100, k, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = avx2.gemm_pack(weight)
    full = avx2.gemm(x, packed, n, bias)
    for first, m in SUB_BATCHES:
        assert torch.equal(avx2.gemm(x[first : first + m].clone(), packed, n, bias), full[first : first + m])
    assert torch.equal(_one_thread(lambda: avx2.gemm(x[:37], packed, n, bias)), full[:37])
    want = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(full.double(), want, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("name", list(SHAPES))
def test_float32_rows_do_not_depend_on_the_batch(avx2, name):
    """gemm_f32 as test_gemm.py checks it on an AVX2-only CPU: sub-batches and one thread bit for bit, each element
    within one float32 chain's error bound of the float64 product."""
    n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(n * k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(100, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = avx2.gemm_pack_f32(weight)
    full = avx2.gemm_f32(x, packed, n, bias)
    for first, m in SUB_BATCHES:
        assert torch.equal(avx2.gemm_f32(x[first : first + m].clone(), packed, n, bias), full[first : first + m])
    assert torch.equal(_one_thread(lambda: avx2.gemm_f32(x[:37], packed, n, bias)), full[:37])
    want = F.linear(x.double(), weight.double(), bias.double())
    bound = (k + 1) * 2**-24 * F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    assert bool(((full.double() - want).abs() <= bound).all())
