"""bf16 linear layers on CPU with weights packed once into oneDNN's blocked layout.

`F.linear` on bf16 CPU tensors calls oneDNN with the weight in plain row-major layout, and oneDNN reorders it
into the blocked (AMX/VNNI) layout on every call. For the small row counts of decodes and warm prefills
(M = 1..256) that reorder is ~30% of the matmul; packing each weight once at load time removes it. The
results are bit-identical to `F.linear` (same kernel, same accumulation order), measured on SmolLM2's shapes.
Used only for bfloat16 on CPUs where oneDNN supports it; float32 stays on `F.linear` (the exactness mode).

Not row-invariant: oneDNN picks its kernel and blocking by the row count, so a row's bits can differ between a
1-row, a 33-row and a 200-row product (on Intel's AMX kernels at many counts, on AMD Zen at one row). The
"onednn" matmul path therefore runs only with cache invariance off; see prefixkv.model.matmul.
"""

from __future__ import annotations

import torch

# oneDNN picks the blocked layout for an expected row count; any count works with any layout, and 128 was as
# fast as an exact hint for M = 1, 50 and 2048 on SmolLM2's shapes
_BATCH_HINT = 128


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported is not None and supported() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 weight -> opaque oneDNN tensor for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out], equal to F.linear(x, weight, bias) for the weight `packed` came from."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
