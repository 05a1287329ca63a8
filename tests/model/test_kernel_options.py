"""KernelOptions: the defaults follow device / dtype / build, impossible choices are refused up front, and the
model's fused-ops and matmul switches follow the runner's options."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from prefixkv.model import matmul, native
from prefixkv.model.options import KernelOptions

CPU = torch.device("cpu")


def test_defaults_follow_dtype_and_build(smol):
    fp32 = KernelOptions.choose(CPU, torch.float32, smol.config)
    # float32: only bit-exact fast paths; the sum-reordering ones (cascade, split) stay off
    assert (fp32.cascade_decodes, fp32.split_prefill, fp32.fused_ops) == (False,) * 3
    # float32's own row-invariant product where the AVX2 build has it (torch's is slow there), else F.linear
    assert fp32.matmul == ("avx2" if native.gemm_f32() is not None else "torch") and not fp32.cache_invariant
    assert fp32.in_place_decodes == (native.module() is not None)
    bf16 = KernelOptions.choose(CPU, torch.bfloat16, smol.config)
    assert bf16.cascade_decodes and bf16.split_prefill
    assert bf16.fused_ops == (native.fused_ops() is not None)
    # the fastest row-invariant matmul where the kernels run (cache invariance on), else oneDNN's packed weights
    # where oneDNN has bf16 (AVX512_BF16), else prefixkv's AVX2 kernel (an AVX2-only CPU such as AMD EPYC Zen 3,
    # where torch emulates bf16), else F.linear
    paths = matmul.available(CPU, torch.bfloat16)
    library = "onednn" if "onednn" in paths else "avx2" if "avx2" in paths else "torch"
    assert bf16.matmul == (matmul.best_row_invariant(CPU, torch.bfloat16) or library)
    assert bf16.cache_invariant == (bf16.matmul in matmul.ROW_INVARIANT_PATHS and bf16.native_attention)
    variant = KernelOptions.choose(CPU, torch.bfloat16, smol.config, cache_invariant=False)
    assert variant.matmul == library
    assert KernelOptions.choose(CPU, torch.float16).cascade_decodes
    assert KernelOptions.choose(CPU, torch.bfloat16, smol.config, cascade_decodes=False).cascade_decodes is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        bf16.cascade_decodes = False  # type: ignore[misc]


def test_impossible_options_are_refused(tiny_checkpoint):
    from prefixkv.model.loader import load_model
    from prefixkv.model.runner import ModelRunner

    with pytest.raises(ValueError, match="unknown kernel options"):
        KernelOptions.choose(CPU, torch.float32, cascade=True)
    with pytest.raises(ValueError, match="fused_ops"):
        KernelOptions.choose(CPU, torch.float32, fused_ops=True)
    with pytest.raises(ValueError, match="matmul 'onednn' cannot run here"):
        KernelOptions.choose(CPU, torch.float32, matmul="onednn")
    with pytest.raises(ValueError, match="matmul must be one of"):
        KernelOptions.choose(CPU, torch.bfloat16, matmul="mkl")
    with pytest.raises(ValueError, match="cascade_decodes takes a bool"):
        KernelOptions.choose(CPU, torch.bfloat16, cascade_decodes="onednn")
    if native.flash_attention() is not None:
        with pytest.raises(ValueError, match="cache_invariant needs .* row-invariant matmul"):
            KernelOptions.choose(CPU, torch.bfloat16, cache_invariant=True, matmul="onednn")
    loaded = load_model(tiny_checkpoint("qwen2")[0])  # head_dim 16: the fused kernels do not cover it
    assert not KernelOptions.choose(CPU, torch.bfloat16, loaded.config).fused_ops
    if native.fused_ops() is not None:
        with pytest.raises(ValueError, match="fused_ops"):
            KernelOptions.choose(CPU, torch.bfloat16, loaded.config, fused_ops=True)
    with pytest.raises(ValueError, match="fused_ops"):  # the runner checks options it is handed
        ModelRunner(loaded, num_pages=4, page_size=16, options=KernelOptions(fused_ops=True))


@pytest.mark.skipif("onednn" not in matmul.available(CPU, torch.bfloat16), reason="oneDNN bf16 matmul not supported")
def test_model_switches_follow_the_runner_options(tiny_checkpoint):
    from prefixkv.model.loader import load_model
    from prefixkv.model.runner import ModelRunner

    loaded = load_model(tiny_checkpoint("llama")[0])
    runner = ModelRunner(loaded, num_pages=4, page_size=16, dtype="bfloat16")
    mlp = runner.model.layers[0].mlp
    assert runner.model.kernel_options is runner.options and runner.options.matmul != "torch"
    assert mlp.gate_up_proj.packed.path == runner.options.matmul == runner.model.lm_head_packed.path
    plain = dataclasses.replace(runner.options, matmul="torch", cache_invariant=False, fused_decode=False)
    runner = ModelRunner(loaded, num_pages=4, page_size=16, options=plain)
    assert mlp.gate_up_proj.packed is None and runner.model.lm_head_packed is None
    assert runner.model.kernel_options is plain


def test_without_the_native_kernels_torch_paths_run_and_invariance_is_reported_off():
    """Where the native kernels do not run (a CPU with neither AMX nor AVX512_BF16; forced here in a process of its
    own with PREFIXKV_NO_NATIVE=1), bf16 runs torch's and oneDNN's kernels, and says so."""
    code = (
        "import torch; from prefixkv.model.options import KernelOptions; "
        "o = KernelOptions.choose('cpu', torch.bfloat16); print(o.isa_path, o.matmul, o.cache_invariant)"
    )
    env = {**os.environ, "PREFIXKV_NO_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    library = "onednn" if "onednn" in matmul.available(CPU, torch.bfloat16) else "torch"
    assert out.stdout.split() == ["torch", library, "False"]


def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch):
    """An AVX2-only CPU (AMD EPYC Zen 3) emulates bf16 in torch: the start log says float32 is faster there, unless
    prefixkv's AVX2 matmul runs the products."""
    from prefixkv.llm import dtype_hint
    from prefixkv.model import cpu_features

    monkeypatch.setattr(cpu_features, "has", lambda flag: False)
    monkeypatch.setattr(cpu_features, "has_amx", lambda: False)
    torch_paths = {"device": "cpu", "matmul": "torch"}
    hint = dtype_hint(torch_paths, "bfloat16")
    assert hint is not None and "AVX512_BF16" in hint and "--dtype float32" in hint
    assert dtype_hint(torch_paths, "float32") is None
    assert dtype_hint({**torch_paths, "device": "cuda"}, "bfloat16") is None
    assert dtype_hint({**torch_paths, "matmul": "avx2"}, "bfloat16") is None
    monkeypatch.setattr(cpu_features, "has", lambda flag: flag == cpu_features.AVX512_BF16)
    assert dtype_hint(torch_paths, "bfloat16") is None
