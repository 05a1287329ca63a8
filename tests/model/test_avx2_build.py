"""The AVX2 variant of the native build (native.VARIANTS["avx2"], tests/model/native_builds.py) on any CPU that
runs AVX2 + FMA: it is the AVX2 build and it loads beside the main one. Its kernels run the tests of the main
build's: test_gemm.py (bf16 gemm and the float32 gemm_f32, which only an AVX2 build has), and
test_invariant_attention.py and test_native_attention.py ("avx2_build").
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import native
from tests.model.native_builds import AVX2, module


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
