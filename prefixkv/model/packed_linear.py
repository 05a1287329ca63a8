"""bf16 linear layers on CPU with weights packed once into oneDNN's blocked layout.

`F.linear` on bf16 CPU tensors calls oneDNN with the weight in plain row-major layout, and oneDNN reorders it
into the blocked (AMX/VNNI) layout on every call. For the small row counts of decodes and warm prefills
(M = 1..256) that reorder is ~30% of the matmul; packing each weight once at load time removes it. The
results are bit-identical to `F.linear` (same kernel, same accumulation order), measured on SmolLM2's shapes.
Used only for bfloat16 on CPUs where oneDNN supports it; float32 stays on `F.linear` (the exactness mode).

Row invariance (for cache-invariant bf16): a row's result is the same in any product of 2 or more rows, at any
index, but oneDNN may compute a single row with another kernel whose sum differs (SmolLM2's down projection,
K = 1536; not its other shapes). `single_row_agrees` measures that per weight shape once, and `packed_linear_rows`
computes a single row as two copies of it where it disagrees, so a row never depends on its batch
(tests/model/test_invariant_attention.py checks both facts). Padding costs ~40% of a one-row product, so it is
used only where the measurement says it is needed.
"""

from __future__ import annotations

import torch

_SINGLE_ROW_AGREES: dict[tuple, bool] = {}  # (out, in, dtype, threads) -> measured by single_row_agrees

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


def single_row_agrees(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether a one-row product equals that row in a batch for this weight's shape (measured once per shape and
    thread count on random rows: oneDNN picks its kernel by shape, so one shape's answer holds for all inputs)."""
    key = (*weight.shape, weight.dtype, torch.get_num_threads())
    if key not in _SINGLE_ROW_AGREES:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, weight.shape[1], generator=gen).to(weight.dtype)
        batch = packed_linear(x, packed, None)
        _SINGLE_ROW_AGREES[key] = all(
            torch.equal(packed_linear(x[i : i + 1].clone(), packed, None)[0], batch[i]) for i in range(len(x))
        )
    return _SINGLE_ROW_AGREES[key]


def packed_linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """packed_linear of x [rows, in] whose every row equals that row's result in any batch of rows (for a weight
    whose single_row_agrees is False; else packed_linear already is)."""
    if x.shape[0] != 1:
        return packed_linear(x, packed, bias)
    return packed_linear(x.expand(2, -1).contiguous(), packed, bias)[:1]
