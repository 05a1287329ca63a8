"""Weight-only quantized matrix weights: GGUF blocks kept as the file ships them, or made at load (q8_0).

A decode step of one stream reads every weight once, so its time is the weights' bytes over the memory bandwidth:
bf16 reads 2 bytes a weight, q8_0 1.06, q4_1 0.63, q4_0 0.56. With `weight_format` other than "dense" the matmul
weights are read in such a block format by the native qgemm kernel (csrc/gemm_q.cpp: the blocks are turned into
fp32 in registers, multiplied with the bf16 activations and summed in fp32 in a fixed order over K, so a row's
result does not depend on its batch, as with the bf16 kernels). Activations, norms, attention and the KV pool stay
bf16.

- "gguf": the GGUF's own blocks for every weight the file stores as q8_0, q4_0 or q4_1 (SmolLM2's file: q4_1
  layers, a q8_0 embedding, which is also the lm_head); weights stored otherwise (f32, f16, bf16) stay dense.
- "q8_0": every matmul weight quantized to q8_0 at load (from a GGUF's dequantized values or a safetensors
  checkpoint), 32 weights per fp16 scale, as llama.cpp's quantizer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixkv.model import native

BLOCK = 32  # weights per block in every format here
# bytes per block: fp16 scale (+ fp16 min for q4_1) and the quantized values
BLOCK_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16, "q4_1": 4 + 16}
FORMATS = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class QuantizedBlocks:
    """A weight [rows, k] in GGUF block format: blocks is uint8 [rows, k / 32 * BLOCK_BYTES[format]]."""

    format: str
    blocks: np.ndarray
    k: int

    def __post_init__(self) -> None:
        if self.format not in BLOCK_BYTES:
            raise ValueError(f"block format {self.format!r} is not supported (supported: {', '.join(FORMATS)})")
        row_bytes = self.k // BLOCK * BLOCK_BYTES[self.format]
        if self.k % BLOCK or self.blocks.ndim != 2 or self.blocks.shape[1] != row_bytes:
            raise ValueError(f"{self.format} blocks of shape {self.blocks.shape} do not hold rows of {self.k} weights")

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def __deepcopy__(self, memo: dict) -> QuantizedBlocks:
        return self  # read only: copies of a model (tests' model views) share their checkpoint's blocks


def concat_rows(parts: list[QuantizedBlocks]) -> QuantizedBlocks | None:
    """The blocks of weights stacked by rows (the fused q/k/v and gate/up weights), or None when the parts are
    not all in one format (the fused weight then gets no file blocks)."""
    if len({(p.format, p.k) for p in parts}) != 1:
        return None
    return QuantizedBlocks(parts[0].format, np.concatenate([p.blocks for p in parts], axis=0), parts[0].k)


def quantize_q8_0(weight: torch.Tensor) -> QuantizedBlocks:
    """q8_0 blocks of a float weight [rows, k] (k a multiple of 32), rounded as llama.cpp's quantizer rounds."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    rows, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"q8_0 needs rows of a multiple of {BLOCK} weights, got {k}")
    values = weight.detach().to(torch.float32).cpu().numpy()
    return QuantizedBlocks("q8_0", quantize(values, GGMLQuantizationType.Q8_0).reshape(rows, -1), k)


def dequantize(q: QuantizedBlocks) -> torch.Tensor:
    """The fp32 weight [rows, k] the blocks stand for."""
    return dequantize_raw(q.blocks, q.format).reshape(q.rows, q.k)


def dequantize_raw(raw: np.ndarray, fmt: str) -> torch.Tensor:
    """The fp32 values of a run of `fmt` blocks (any shape of uint8, whole blocks in order), flat.

    The format's definition is gguf's own dequantizer (gguf/quants.py): q8_0 d * q, q4_0 d * (q - 8), q4_1
    d * q + m, from fp16 d and m. Each product is exact in fp32 (an 11-bit significand times at most 8 bits), so
    this whole-array version gives its bits exactly (tests/model/test_gguf.py compares the default model's q8_0 and
    q4_1 blocks and random blocks of each format) in a few passes over memory: ~0.3 s for SmolLM2-135M where gguf's
    row groups took 2-3 s (AMD EPYC Zen 3), paid by every process that loads the model."""
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES[fmt]))  # a copy: raw is a memmap
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    values = torch.empty(blocks.shape[0], BLOCK)
    if fmt == "q8_0":
        values.copy_(blocks[:, 2:].view(torch.int8))
        return values.mul_(scale).flatten()
    packed = blocks[:, -BLOCK // 2 :]  # value j in the low nibble of byte j, value j + 16 in its high nibble
    values[:, : BLOCK // 2].copy_(packed & 0x0F)
    values[:, BLOCK // 2 :].copy_(packed >> 4)
    if fmt == "q4_0":
        return values.sub_(8).mul_(scale).flatten()
    minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return values.mul_(scale).add_(minimum).flatten()


def pack(q: QuantizedBlocks) -> torch.Tensor:
    """The blocks in the layout qgemm reads."""
    kernels = native.qgemm()
    if kernels is None:
        raise ValueError("quantized weights need the native qgemm kernel (an AVX-512 CPU and the native build)")
    blocks = np.array(q.blocks, dtype=np.uint8, order="C")  # a writable copy: GGUF blocks are a read-only memmap
    return kernels.qgemm_pack(torch.from_numpy(blocks), q.k, q.format)
