"""prefixkv's weight-only quantized matrix product on the GGUF's own blocks (csrc/gemm_q.cpp): q8_0, q4_0, q4_1.

The reference is the gguf package's own quantize and dequantize (gguf/quants.py): qgemm must be the product of
the bf16 activations with the dequantized weights, up to float32 summation error and one rounding to bf16, and a
row's bits must never depend on the other rows of the call (how many, where the row sits, the tiles and threads).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from prefixkv.model import cpu_features, native
from tests import kernels


def _qgemm_module():
    m = native.module()
    return m if m is not None and hasattr(m, "has_qgemm") and m.has_qgemm() else None


pytestmark = kernels.requires(cpu_features.AVX512_BF16, _qgemm_module, "the quantized matrix product (qgemm)")

FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # per 32 weights: fp16 d (, fp16 m), the quantized values
PACKED_BYTES = {"q8_0": 1088, "q4_0": 576, "q4_1": 640}  # per (32 columns x 32 K), scales included
SHAPES = {  # (N, K): SmolLM2's qkv and down, and columns that are not a multiple of 16 or 32
    "qkv": (960, 576),
    "down": (576, 1536),
    "n72_k64": (72, 64),
    "n8_k32": (8, 32),
    "n130_k96": (130, 96),
}


def _q():
    return _qgemm_module()


def _quantized(n: int, k: int, fmt: str, seed: int) -> torch.Tensor:
    """gguf's blocks of a random [n, k] weight (uint8 [n, k / 32 * block bytes])."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * np.float32(k**-0.5)
    return torch.from_numpy(quants.quantize(w, FORMATS[fmt]))


def _random_blocks(n: int, k: int, fmt: str, seed: int) -> torch.Tensor:
    """Blocks of random bytes (every int8 and nibble value) with random finite fp16 scales, as gguf reads them."""
    rng = np.random.default_rng(seed)
    bb, scales = BLOCK_BYTES[fmt], 4 if fmt == "q4_1" else 2
    blocks = rng.integers(0, 256, size=(n, k // 32, bb), dtype=np.uint8)
    half = rng.uniform(-0.02, 0.02, size=(n, k // 32, scales // 2)).astype(np.float16)
    blocks[:, :, :scales] = half.view(np.uint8).reshape(n, k // 32, scales)
    return torch.from_numpy(blocks.reshape(n, -1))


def _parse(blocks: torch.Tensor, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks' d and m ([N, K / 32]) and quantized values q ([N, K]) as float64, with w = d q + m; checked
    against gguf's dequantization, which computes d q + m in float32 (d q exact: 11 by at most 8 bits)."""
    n, bb = blocks.shape[0], BLOCK_BYTES[fmt]
    raw = blocks.numpy().reshape(n, -1, bb)
    d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    m = np.zeros_like(d)
    if fmt == "q8_0":
        q = raw[:, :, 2:].copy().view(np.int8).astype(np.float64)
    else:
        qs = raw[:, :, 4:] if fmt == "q4_1" else raw[:, :, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64) - (8 if fmt == "q4_0" else 0)
        if fmt == "q4_1":
            m = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
    w32 = (d[:, :, None].astype(np.float32) * q.astype(np.float32) + m[:, :, None].astype(np.float32)).reshape(n, -1)
    assert np.array_equal(w32, quants.dequantize(blocks.numpy(), FORMATS[fmt]))
    return d, m, q.reshape(n, -1)


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _to_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 -> bf16, both round-to-nearest-even: a monotone function, as the kernel's rounding is."""
    return v.to(torch.float32).to(torch.bfloat16)


def _check_accurate(got: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias) -> float:
    """got lies between the bf16 roundings of ref - E and ref + E, where ref is the float64 product of x with gguf's
    dequantized weights (+ bias) and E bounds the kernel's float32 error before its one rounding to bf16; returns
    the fraction of results the bound pins to one bf16 value.

    E, to first order in u = 2^-24 (times 1.01 for the rest): every rounding errs by at most u times the value it
    rounds. Per block b: s_b, 16 dot products of K pairs from zero (the products x q of bf16 and a small integer
    are exact; <= 2 roundings each, of the partial sum with one or both products: <= |P_j-1| + |pair| and |P_j|),
    then acc = fma(s_b, d_b, acc) (|d_b| times s_b's error, and u |acc|); q4_1 also adds fma(sum_x_b, m_b, acc)
    (sum_x_b by a 5-deep tree of additions: <= 5 u sum |x|); then acc + bias (u |y|). gguf's own q4_1 weights
    d q + m are float32 roundings of the exact ones (u |w| each). Rounding to bf16 is monotone, so the result lies
    between the roundings of the two ends of [ref - E, ref + E]; an exact statement, however E compares to a bf16
    ulp."""
    d, m, q = (torch.from_numpy(a) for a in _parse(blocks, fmt))
    rows, k = x.shape
    n, nb = d.shape
    xd = x.double()
    pairs = (xd[:, None, :] * q[None, :, :]).view(rows, n, nb, 16, 2)  # the products x q, exact here and in float32
    pair_sum = pairs.sum(-1)
    partial = pair_sum.cumsum(-1)  # P_j within each block: [M, N, nb, 16]
    s_err = (partial.abs() + (partial - pair_sum).abs() + pairs.abs().sum(-1)).sum(-1)  # [M, N, nb]
    terms = partial[..., -1] * d
    units = (s_err * d.abs()).sum(-1)  # the bound in units of u
    if fmt == "q4_1":
        xsum = xd.view(rows, 1, nb, 32).sum(-1)
        after_d = terms.cumsum(-1) + torch.nn.functional.pad((xsum * m).cumsum(-1)[..., :-1], (1, 0))
        units += after_d.abs().sum(-1) + (5 * xd.abs().view(rows, 1, nb, 32).sum(-1) * m.abs()).sum(-1)
        terms = terms + xsum * m
        w_exact = (d[:, :, None] * q.view(n, nb, 32) + m[:, :, None]).view(n, k)
        units += xd.abs() @ w_exact.abs().T  # gguf's float32 weights
    running = terms.cumsum(-1)
    y = running[..., -1] + (0 if bias is None else bias.double())
    units += running.abs().sum(-1) + y.abs()
    w_gguf = torch.from_numpy(quants.dequantize(blocks.numpy(), FORMATS[fmt])).double()
    ref = xd @ w_gguf.T + (0 if bias is None else bias.double())
    err = 1.01 * 2.0**-24 * units + k * 2.0**-53 * (xd.abs() @ w_gguf.abs().T) + 1e-30
    lo, hi = _to_bf16(ref - err), _to_bf16(ref + err)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    inside = (got >= lo) & (got <= hi)
    assert bool(inside.all()), (got.double() - ref).abs()[~inside].max()
    return (lo == hi).double().mean().item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", SHAPES)
def test_the_product_is_accurate(fmt, name):
    """qgemm of gguf-quantized weights and of random blocks (every quantized value, random scales) equals the
    product with gguf's dequantization up to float32 summation error and one bf16 rounding; with and without bias."""
    n, k = SHAPES[name]
    x = _rows(6, k, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for blocks in (_quantized(n, k, fmt, 1), _random_blocks(n, k, fmt, 2)):
        packed = _q().qgemm_pack(blocks, k, fmt)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 32) * (k // 32) * PACKED_BYTES[fmt]
        for b in (None, bias):
            pinned = _check_accurate(_q().qgemm(x, packed, n, fmt, b), x, blocks, fmt, b)
            # the bound is tight: it leaves one bf16 value possible for almost every result
            assert pinned > 0.9, pinned


def test_bytes_per_weight():
    """The packed layout reads as few bytes per weight as the GGUF blocks (scales included)."""
    n, k = 64, 128
    for fmt, per_weight in (("q8_0", 34 / 32), ("q4_0", 18 / 32), ("q4_1", 20 / 32)):
        blocks = _quantized(n, k, fmt, 0)
        assert blocks.numel() == n * k * per_weight
        assert _q().qgemm_pack(blocks, k, fmt).numel() == n * k * per_weight


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["qkv", "n130_k96"])
def test_rows_do_not_depend_on_the_batch(fmt, name):
    """Each row of a 200-row product, bit for bit, computed in sub-batches of every tail size (1 to 17 rows, and
    33, 64), at any offset, inside batches of other rows, and with one thread."""
    n, k = SHAPES[name]
    blocks = _quantized(n, k, fmt, 4)
    packed = _q().qgemm_pack(blocks, k, fmt)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x = _rows(200, k, 6)
    full = _q().qgemm(x, packed, n, fmt, bias)
    spans = [(0, m) for m in range(1, 18)] + [(199, 1), (7, 2), (3, 5), (41, 33), (100, 64), (13, 9), (150, 50)]
    for first, m in spans:
        part = _q().qgemm(x[first : first + m].clone(), packed, n, fmt, bias)
        assert torch.equal(part, full[first : first + m]), f"rows [{first}, {first + m})"
    # rows in other company: shuffled, and among rows of another batch
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(7))[:45]
    mixed = torch.cat([_rows(11, k, 8), x[perm], _rows(3, k, 9)])
    assert torch.equal(_q().qgemm(mixed, packed, n, fmt, bias)[11:56], full[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_q().qgemm(x[:37], packed, n, fmt, bias), full[:37])
    finally:
        torch.set_num_threads(threads)


def test_bias_strides_and_empty():
    """A zero bias changes no bit; rows of a wider tensor (a row stride) and a transposed view give the same bits
    as contiguous rows; M = 0 gives an empty [0, N]."""
    n, k = 96, 64
    blocks = _quantized(n, k, "q4_1", 10)
    packed = _q().qgemm_pack(blocks, k, "q4_1")
    x = _rows(20, k, 11)
    want = _q().qgemm(x, packed, n, "q4_1")
    assert torch.equal(_q().qgemm(x, packed, n, "q4_1", torch.zeros(n, dtype=torch.bfloat16)), want)
    wide = torch.cat([_rows(20, k, 12), x, _rows(20, 1, 13)], dim=1)[:, k : 2 * k]
    assert wide.stride(0) == 2 * k + 1
    assert torch.equal(_q().qgemm(wide, packed, n, "q4_1"), want)
    assert torch.equal(_q().qgemm(x.T.contiguous().T, packed, n, "q4_1"), want)
    assert _q().qgemm(x[:0], packed, n, "q4_1").shape == (0, n)


def test_bad_inputs_are_refused():
    n, k = 64, 64
    blocks = _quantized(n, k, "q4_0", 14)
    packed = _q().qgemm_pack(blocks, k, "q4_0")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _q().qgemm_pack(blocks, 48, "q4_0")
    with pytest.raises(RuntimeError, match="unknown format 'q5_0'"):
        _q().qgemm_pack(blocks, k, "q5_0")
    with pytest.raises(RuntimeError, match="unknown format 'q5_0'"):
        _q().qgemm(_rows(2, k, 0), packed, n, "q5_0")
    with pytest.raises(RuntimeError, match="uint8"):
        _q().qgemm_pack(blocks.to(torch.int16), k, "q4_0")
    with pytest.raises(RuntimeError, match="take 68 bytes a row, got 36"):
        _q().qgemm_pack(blocks, k, "q8_0")  # q4_0 rows are 36 bytes, q8_0's would be 68
    with pytest.raises(RuntimeError, match="bf16"):
        _q().qgemm(_rows(2, k, 0).float(), packed, n, "q4_0")
    with pytest.raises(RuntimeError, match="x has 96 columns"):
        _q().qgemm(_rows(2, 96, 0), packed, n, "q4_0")
    with pytest.raises(RuntimeError, match="packed must come from qgemm_pack"):
        _q().qgemm(_rows(2, k, 0), packed, n, "q4_1")  # another format's layout
    with pytest.raises(RuntimeError, match="packed must come from qgemm_pack"):
        _q().qgemm(_rows(2, k, 0), packed, 200, "q4_0")  # another N
    with pytest.raises(RuntimeError, match="bias must be bf16"):
        _q().qgemm(_rows(2, k, 0), packed, n, "q4_0", torch.zeros(n))
