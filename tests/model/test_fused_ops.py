"""The native one-pass bf16 kernels (prefixkv/model/csrc/fused/: AVX-512 rows, or AVX2 + FMA ones) equal torch's
bf16 ops, on the main build and on the AVX2 variant (tests/model/native_builds.py).

They round to bf16 wherever torch's ops do, so outputs match bit for bit except where the float32 sums inside
differ in order (RMSNorm's sum of squares, SiLU's exp): then by at most one bf16 step, on a tiny share of values.
Model level: SmolLM2 in bf16 gives the same greedy tokens with the kernels and with torch's ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model import native
from prefixkv.model.rope import apply_rotary
from tests import kernels as kernel_marks
from tests.model.native_builds import AVX2, MAIN, module

pytestmark = kernel_marks.FUSED_OPS
kernels = native.fused_ops()
BF16 = torch.bfloat16
BUILDS = pytest.mark.parametrize("build", [MAIN, AVX2])


def _kernels(build: str):
    """The module whose kernels a test runs: the main build's (native.fused_ops()) or the AVX2 variant's."""
    return kernels if build == MAIN else module(build)


def assert_nearly_identical(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    differ = got != expected
    assert differ.float().mean().item() <= 1e-3
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)  # one bf16 step


@BUILDS
@pytest.mark.parametrize("rows", [1, 50, 333])
def test_silu_mul(rows, build):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(BF16)
    gate, up = gate_up.split(1536, dim=-1)
    assert_nearly_identical(_kernels(build).silu_mul(gate_up), F.silu(gate).mul_(up))


@BUILDS
@pytest.mark.parametrize("rows", [1, 50, 333])
def test_rms_norm(rows, build):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 576, generator=gen) * 3).to(BF16)[:, :576]  # strided rows
    weight = (torch.randn(576, generator=gen) * 0.2 + 1).to(BF16)
    expected = weight * F.rms_norm(x.float(), (576,), eps=1e-5).to(BF16)
    assert_nearly_identical(_kernels(build).rms_norm(x, weight, 1e-5), expected)


@BUILDS
@pytest.mark.parametrize("rows", [1, 50, 333])
def test_rotary(rows, build):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 960, generator=gen).to(BF16)
    qk = qkv[:, :768].view(rows, 12, 64)  # q and k heads of a fused qkv row, as the model passes them
    angles = torch.arange(rows).float()[:, None] * (10000.0 ** (-torch.arange(0, 64, 2).float() / 64))[None]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(BF16)[:, None, :], emb.sin().to(BF16)[:, None, :]
    assert_nearly_identical(_kernels(build).rotary(qk, cos, sin), apply_rotary(qk, cos, sin))


def test_smollm2_bf16_same_tokens_with_and_without_kernels(smol_bf16, smol_prompts):
    from dataclasses import replace

    from prefixkv.model.runner import ModelRunner
    from tests.model.helpers import greedy_generate

    runner = ModelRunner(smol_bf16, num_pages=64, page_size=16)
    # the attention path stays torch's on both sides: with the native attention kernel, this prompt's first token
    # is an exact bf16 tie (tokens 60 and 504 both at logit 25.375), which the fused ops' last-bit changes flip
    torch_attention = dict(
        native_attention=False, amx_attention=False, shared_prefill=False, cache_invariant=False, fused_decode=False
    )
    options = replace(runner.options, **torch_attention)
    runner = ModelRunner(smol_bf16, num_pages=64, page_size=16, options=options)
    assert runner.options.fused_ops and runner.model.layers[0].mlp.fused is kernels
    prompt = smol_prompts[0]
    with_kernels = greedy_generate(runner, prompt, 12)
    runner = ModelRunner(smol_bf16, num_pages=64, page_size=16, options=replace(runner.options, fused_ops=False))
    assert runner.model.layers[0].mlp.fused is None
    assert greedy_generate(runner, prompt, 12) == with_kernels
