"""GGUF -> (ModelConfig, HF-named float tensors). One canonical naming (HF's) so the model has one load path."""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from prefixkv.model.config import ModelConfig
from prefixkv.model.gguf_file import GGUFFile
from prefixkv.model.quantized import BLOCK_BYTES, QuantizedBlocks, dequantize_raw

SUPPORTED_QTYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """Our (HF) name for a GGUF tensor name, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for Llama models.

    llama.cpp's converter reorders each head's rows from HF's "rotate_half" layout (first half / second half)
    to interleaved pairs (x0, x_{d/2}, x1, ...). We compute rotary the HF way, so put the rows back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    if tensor.qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"tensor {tensor.name}: GGUF type {tensor.qtype.name} is not supported")
    if tensor.qtype == GGMLQuantizationType.F32:
        flat = tensor.raw.view(np.float32).copy()  # the memmap is read-only
    elif tensor.qtype == GGMLQuantizationType.F16:
        flat = tensor.raw.view(np.float16).astype(np.float32)
    elif tensor.qtype.name.lower() in BLOCK_BYTES:
        flat = dequantize_raw(tensor.raw, tensor.qtype.name.lower()).numpy()
    else:
        flat = dequantize(tensor.raw, tensor.qtype)
    return flat.reshape(tensor.shape)


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict, dict[str, QuantizedBlocks]]:
    """Read a GGUF file: config, float32 tensors in HF naming, the raw metadata, and the file's own blocks of the
    2-D tensors it stores as q8_0 / q4_0 / q4_1 (HF naming, q/k rows un-permuted like the float tensors)."""
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, has_output_weight="output.weight" in gguf.tensors)
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedBlocks] = {}
    for name, tensor in gguf.tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        w = _dequantize(tensor)
        raw = _own_blocks(tensor, w.shape)
        if config.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            n_head = config.num_heads if ".attn_q." in name else config.num_kv_heads
            w = unpermute_rotary(w, n_head)
            raw = None if raw is None else QuantizedBlocks(raw.format, unpermute_rotary(raw.blocks, n_head), raw.k)
        state[target] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        if raw is not None:
            blocks[target] = raw
    if "rope_freqs.weight" in gguf.tensors:
        # llama3-style rope stored as per-frequency divisors instead of metadata.
        factors = _dequantize(gguf.tensors["rope_freqs.weight"])
        config.rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    return config, state, gguf.metadata, blocks


def _own_blocks(tensor, shape: tuple[int, ...]) -> QuantizedBlocks | None:
    """The tensor's raw blocks, one row per output feature, when it is a matrix in a block format qgemm reads."""
    fmt = tensor.qtype.name.lower()
    if fmt not in BLOCK_BYTES or len(shape) != 2:
        return None
    return QuantizedBlocks(fmt, np.asarray(tensor.raw).reshape(shape[0], -1), shape[1])
