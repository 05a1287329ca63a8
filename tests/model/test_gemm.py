"""prefixkv's own bf16 matrix product (csrc/gemm/gemm.cpp; matmul path "avx512_bf16", or "avx2" on a CPU without
AVX-512), and the float32 one of every AVX2 + FMA build (gemm_f32, the float32 path): accurate, and row-invariant.

Row invariance is the point of the kernel (cache-invariant bf16): a row's bits must not depend on how many rows
the call has, where the row sits, how the rows split into tiles and row blocks, or how many threads run. It is
checked bit for bit on SmolLM2's projections and on shapes with every kind of tail (rows, columns, odd K), on the
main build and on the AVX2 variant (tests/model/native_builds.py), so the AVX2 kernels run on AVX-512 CPUs too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import matmul, native
from tests import kernels
from tests.model.native_builds import AVX2, MAIN, module

pytestmark = kernels.NATIVE_GEMM

SMOLLM2 = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
# columns not a multiple of 16 or 64, odd K, K not a multiple of 32
ODD = {"n72_k40": (72, 40), "n8_k33": (8, 33), "n130_k97": (130, 97)}


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _kernels(build: str):
    """The module whose products a test runs: the main build's (native.gemm()) or the AVX2 variant's."""
    return native.gemm() if build == MAIN else module(build)


@pytest.mark.parametrize("build", [MAIN, AVX2])
@pytest.mark.parametrize("name", [*SMOLLM2, *ODD])
def test_rows_do_not_depend_on_the_batch(name, build):
    """Every sub-batch (row counts around the 6-row tiles (AVX2: 2-row), the row blocks and the thread split, at
    any offset) and a thread count of 1 give the rows of the 300-row product (with a bias) bit for bit."""
    n, k = {**SMOLLM2, **ODD}[name]
    gemm = _kernels(build)
    weight = _weight(n, k, n + k)
    packed = gemm.gemm_pack(weight)
    x, bias = _rows(300, k, k), _rows(1, n, n)[0]
    full = gemm.gemm(x, packed, n, bias)
    for first, m in ((0, 1), (7, 1), (299, 1), (0, 2), (3, 5), (10, 6), (1, 7), (5, 13), (40, 64), (33, 129)):
        if name == "lm_head" and m > 64:
            continue  # the largest product: the row counts below 64 cover its tiles
        part = gemm.gemm(x[first : first + m].clone(), packed, n, bias)
        assert torch.equal(part, full[first : first + m]), f"rows [{first}, {first + m})"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm.gemm(x[:37], packed, n, bias), full[:37])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", [MAIN, AVX2])
@pytest.mark.parametrize("name", ["qkv", "down", *ODD])
def test_the_product_is_accurate(name, build):
    """Within the rounding of a bf16 result to the float32 product of the same bf16 inputs, as oneDNN is."""
    n, k = {**SMOLLM2, **ODD}[name]
    gemm = _kernels(build)
    weight, x = _weight(n, k, 1), _rows(50, k, 2)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed = gemm.gemm_pack(weight)
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = gemm.gemm(x, packed, n, b).float()
        # one bf16 rounding of the result (2^-8 relative) plus float32 sums in another order
        assert torch.allclose(got, want, rtol=2**-8, atol=1e-5 * k), (got - want).abs().max()


def test_strided_rows_and_the_matmul_wrapper():
    """Rows of a wider tensor (a view with a row stride), 3-d input through matmul.linear, and M = 0."""
    n, k = 96, 64
    weight = _weight(n, k, 4)
    wide = _rows(20, 3 * k, 5)
    x = wide[:, k : 2 * k]
    packed = matmul.pack(weight, native.gemm_isa())
    assert torch.equal(matmul.linear(x, weight, packed, None), native.gemm().gemm(x.contiguous(), packed.data, n))
    x3 = x.reshape(4, 5, k)
    assert torch.equal(matmul.linear(x3, weight, packed, None), matmul.linear(x, weight, packed, None).view(4, 5, n))
    assert matmul.linear(x[:0], weight, packed, None).shape == (0, n)


def test_bad_inputs_are_refused():
    weight = _weight(64, 32, 6)
    packed = native.gemm().gemm_pack(weight)
    with pytest.raises(RuntimeError, match="x has 48 columns"):
        native.gemm().gemm(_rows(2, 48, 0), packed, 64)
    with pytest.raises(RuntimeError, match="packed must come from gemm_pack"):
        native.gemm().gemm(_rows(2, 32, 0), packed, 200)
    with pytest.raises(RuntimeError, match="bf16"):
        native.gemm().gemm(_rows(2, 32, 0).float(), packed, 64)


@pytest.mark.parametrize("build", [pytest.param(MAIN, marks=kernels.GEMM_F32), AVX2])
@pytest.mark.parametrize("name", [*SMOLLM2, *ODD])
def test_float32_rows_do_not_depend_on_the_batch_and_are_accurate(name, build):
    """gemm_f32: every sub-batch (around its 6-row tiles, the single-row tile, any offset) and one thread give the
    rows of the 200-row product bit for bit; each element within the bound of one float32 chain over K (k units
    in the last place of the sum of |x| |w| and |bias|) of the float64 product; 3-d input through matmul.linear."""
    n, k = {**SMOLLM2, **ODD}[name]
    f32 = _kernels(build)
    gen = torch.Generator().manual_seed(n + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(200, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = f32.gemm_pack_f32(weight)
    full = f32.gemm_f32(x, packed, n, bias)
    for first, m in ((0, 1), (199, 1), (3, 2), (10, 3), (1, 5), (5, 6), (7, 13), (40, 64)):
        part = f32.gemm_f32(x[first : first + m].clone(), packed, n, bias)
        assert torch.equal(part, full[first : first + m]), f"rows [{first}, {first + m})"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(f32.gemm_f32(x[:37], packed, n, bias), full[:37])
    finally:
        torch.set_num_threads(threads)
    want = F.linear(x.double(), weight.double(), bias.double())
    bound = (k + 1) * 2**-24 * F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    assert bool(((full.double() - want).abs() <= bound).all()), (full.double() - want).abs().max()
    if build == MAIN:  # the matmul wrapper (path "avx2") runs the main build: its packing and 3-d input
        wrapped = matmul.pack(weight, "avx2")
        assert wrapped is not None and wrapped.data.dtype == torch.float32
        assert torch.equal(matmul.linear(x, weight, wrapped, bias), full)
        assert torch.equal(matmul.linear(x[:20].reshape(4, 5, k), weight, wrapped, bias), full[:20].view(4, 5, n))


@kernels.GEMM_F32
def test_float32_bad_inputs_are_refused():
    packed = native.module().gemm_pack_f32(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="x has 48 columns"):
        native.module().gemm_f32(torch.randn(2, 48), packed, 64)
    with pytest.raises(RuntimeError, match="packed must come from gemm_pack_f32"):
        native.module().gemm_f32(torch.randn(2, 32), packed, 200)
    with pytest.raises(RuntimeError, match="fp32"):
        native.module().gemm_f32(torch.randn(2, 32).bfloat16(), packed, 64)
