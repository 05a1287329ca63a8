"""Which kernel computes the model's matrix products, and the weight copy each one reads.

Paths (KernelOptions.matmul):
- "torch": F.linear on the plain weight (float32, GPUs, CPUs without bf16 support);
- "onednn": oneDNN with the weight packed once into its blocked layout (packed_linear: same results as F.linear,
  without a reorder per call); fast, but which kernel and summation order it runs depends on the row count, so a
  row's bits can change with its batch;
- "avx512_bf16": prefixkv's own kernel (csrc/gemm/gemm.cpp): every output element is one chain of vdpbf16ps over K in
  order, so a row's bits never depend on how many rows the call has (needed by cache-invariant bf16);
- "amx": the same contract on Intel's AMX tiles (csrc/gemm/gemm_amx.cpp), where the CPU has them and the kernel passed
  its self-test on this machine;
- "avx2": the same kernel's contract on a CPU without AVX-512 (AVX2 + FMA, such as AMD EPYC Zen 3): each K pair
  is two fp32 FMAs. There torch emulates bf16 products (a seventh of this kernel's rate on SmolLM2's shapes) and
  oneDNN has no bf16, so it is the bf16 path there, also with cache invariance off. Every build on an AVX2 + FMA CPU
  (AVX-512 ones too) also has a float32 product with the same contract (one FMA chain over K per output element,
  csrc/gemm/f32_avx2.h), and "avx2" is the float32 path wherever it is: torch's (MKL) reads the weights at a third
  of the memory bandwidth for 1 to 16 rows (AMD EPYC Zen 3 and Zen 4), and its rows change with M.
Weights in a block format (KernelOptions.weight_format, prefixkv.model.quantized) are read by the native qgemm
kernel (csrc/gemm_q.cpp) whatever `matmul` says: their PackedWeight's path is the block format ("q8_0", "q4_0",
"q4_1"), with the same row-invariance contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixkv.model import native, packed_linear, quantized

PATHS = ("torch", "onednn", "avx512_bf16", "amx", "avx2")
# paths whose row results do not depend on the batch, by construction
ROW_INVARIANT_PATHS = ("avx512_bf16", "amx", "avx2")
NATIVE_GEMM_PATHS = ("avx512_bf16", "avx2")  # csrc/gemm/gemm.cpp, compiled for one of them (native.gemm_isa)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [out, in] in the layout one path reads (the plain weight stays with its module)."""

    path: str
    data: torch.Tensor
    out_features: int

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        return self  # read only: a copy of a model (the tests' model views) shares its packed weights


def available(device: torch.device | str, dtype: torch.dtype) -> tuple[str, ...]:
    """The paths that can run here for this device and dtype ("torch" always)."""
    device = torch.device(device)
    paths = ["torch"]
    if packed_linear.can_pack(device, dtype):
        paths.append("onednn")
    if device.type == "cpu" and dtype == torch.bfloat16 and native.gemm() is not None:
        paths.append(native.gemm_isa())
        if native.amx_gemm() is not None:
            paths.append("amx")
    if device.type == "cpu" and dtype == torch.float32 and native.gemm_f32() is not None:
        paths.append("avx2")
    return tuple(paths)


def best_row_invariant(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """The fastest row-invariant path here (AMX where it runs, else AVX512_BF16, else AVX2), or None."""
    paths = available(device, dtype)
    return next((p for p in ("amx", "avx512_bf16", "avx2") if p in paths), None)


def pack(weight: torch.Tensor, path: str) -> PackedWeight | None:
    """The copy of `weight` that `path` reads; None for "torch", which reads the plain weight.

    Made once per weight and path, and kept on the weight: the runners of one loaded model (engines built on a
    shared LoadedModel, as the tests' and a server's beside a reference one) share it instead of each holding a
    copy as large as the weights (float32: 540 MB for SmolLM2). The key holds the weight's storage and version, so
    a weight cast or written in place is packed again."""
    if path == "torch":
        return None
    w = weight.detach()
    key = (path, w.data_ptr(), w.dtype, tuple(w.shape), w._version)
    kept = getattr(weight, _KEPT, None)
    if kept is not None and kept[0] == key:
        return kept[1]
    if path == "onednn":
        data = packed_linear.pack(w)
    elif path in ROW_INVARIANT_PATHS and w.dtype == torch.float32:  # "avx2", gemm_f32 (see available)
        data = native.module().gemm_pack_f32(w.contiguous())
    elif path in ROW_INVARIANT_PATHS:  # one bf16 panel layout for all three (csrc/gemm/gemm.cpp)
        data = native.gemm().gemm_pack(w.contiguous())
    else:
        raise ValueError(f"unknown matmul path {path!r}; one of {PATHS}")
    packed = PackedWeight(path, data, w.shape[0])
    setattr(weight, _KEPT, (key, packed))
    return packed


_KEPT = "_prefixkv_packed"  # the attribute pack() keeps a weight's last packed copy in: (key, PackedWeight)


def pack_quantized(q: quantized.QuantizedBlocks) -> PackedWeight:
    """A weight in block format, as qgemm reads it (its path is the format)."""
    return PackedWeight(q.format, quantized.pack(q), q.rows)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None):
    """x [..., in] @ weight.T (+ bias) by the path `packed` was made for (F.linear when None)."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.path == "onednn":
        return packed_linear.packed_linear(x, packed.data, bias)
    rows = x.reshape(-1, x.shape[-1])
    if packed.path in quantized.FORMATS:
        out = native.module().qgemm(rows, packed.data, packed.out_features, packed.path, bias)
        return out.view(*x.shape[:-1], packed.out_features)
    if packed.data.dtype == torch.float32:
        kernel = native.module().gemm_f32
    else:
        kernel = native.gemm().gemm if packed.path in NATIVE_GEMM_PATHS else native.amx_gemm().amx_gemm
    out = kernel(rows, packed.data, packed.out_features, bias)
    return out.view(*x.shape[:-1], packed.out_features)
