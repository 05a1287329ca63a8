"""Marks for tests that need prefixkv's native CPU kernels: skip only where the CPU lacks the instructions.

A plain `skipif(kernel is None)` also skips when the CPU has the instructions but the build lost the kernel (a
compile error, a changed flag): dozens of tests would pass as skips. `requires` asks /proc/cpuinfo instead: no
instruction set, skip naming it and the CPU; instruction set present but kernel missing, the tests fail.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixkv.model import cpu_features, native


def requires(flag: str, kernel: Callable[[], object], what: str, elsewhere: str = "") -> pytest.MarkDecorator:
    """Module or test mark for a test of `what`, which the native build compiles where the CPU has `flag`
    (/proc/cpuinfo's spelling) and which `kernel()` returns (None when not compiled in). `elsewhere`: what covers
    the same code on a CPU without the flag, said in the skip."""
    if not cpu_features.has(flag):
        reason = f"{what} needs {flag}, which this CPU ({cpu_features.model_name()}) lacks"
        return pytest.mark.skip(reason=reason + (f"; {elsewhere}" if elsewhere else ""))
    if kernel() is None:
        return pytest.mark.kernel_missing(
            f"this CPU ({cpu_features.model_name()}) has {flag} but the native build has no {what} "
            f"(see the warning above, or run python -m prefixkv.model.native)"
        )
    return pytest.mark.skipif(False, reason=f"{what} present")


# the kernels of cache-invariant bf16 and the rest of the native fast paths
AVX512_BF16 = requires(cpu_features.AVX512_BF16, native.flash_attention, "the AVX-512 BF16 attention kernels")
# csrc/attention/flash_attention.cpp's vector path, like csrc/gemm/gemm.cpp, is compiled for AVX512_BF16 where the
# CPU has it, else for AVX2 + FMA: the attention kernels' contract tests (accuracy, a row's bits whatever its chunk,
# batch or caller) and cache-invariant engines run on both
NATIVE_ATTENTION = requires(
    "avx2", native.flash_attention, "the native bf16 attention kernels (AVX512_BF16 or AVX2 + FMA)"
)
GEMM = requires(cpu_features.AVX512_BF16, native.gemm, "the AVX-512 BF16 matrix product")
# csrc/gemm/gemm.cpp is compiled for AVX512_BF16 where the CPU has it, else for AVX2 + FMA (every CPU with AVX-512 has
# AVX2 too): its contract tests run on both
NATIVE_GEMM = requires("avx2", native.gemm, "the native bf16 matrix product (AVX512_BF16 or AVX2 + FMA)")
# csrc/gemm/f32_avx2.h is compiled into every build on a CPU with AVX2 + FMA (AVX-512 ones too): the float32 path
GEMM_F32 = requires("avx2", native.gemm_f32, "the native float32 matrix product (AVX2 + FMA)")
# csrc/fused/ is compiled for AVX-512 where the CPU has it, else for AVX2 + FMA; the decode loop over it, the
# native attention and the product runs wherever all three are built
FUSED_OPS = requires("avx2", native.fused_ops, "the fused elementwise kernels (AVX-512 or AVX2 + FMA)")
DECODE_LAYERS = requires("avx2", native.decode_layers, "the one-call decoder loop (AVX512_BF16 or AVX2 + FMA)")
AMX = requires(
    cpu_features.AMX_BF16,
    native.amx_gemm,
    "the AMX kernels (matrix product and attention)",
    "their amx_emulated twins run the same kernels on AVX-512 tiles in software, and the avx512_bf16 ones beside",
)
