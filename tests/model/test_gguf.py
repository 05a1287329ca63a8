"""GGUF round trip: write tiny checkpoints the way llama.cpp's converter does (names, metadata, Llama q/k
row permutation, quantised types), read them back with our parser and compare with the HF weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from prefixkv.model.config import ModelConfig
from prefixkv.model.gguf_loader import load_gguf
from prefixkv.model.hf_loader import load_hf_dir
from prefixkv.model.quantized import dequantize as dequantize_blocks

_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_gguf(path: str, cfg: ModelConfig, state: dict, qtypes: list[Q]) -> dict[str, np.ndarray]:
    """Write like convert_hf_to_gguf; returns the float weights the file should decode to (HF layout)."""
    arch = cfg.architecture
    w = GGUFWriter(path, arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    expected = {}
    for i, (name, t) in enumerate(sorted(state.items())):
        a = t.float().numpy()
        qtype = qtypes[i % len(qtypes)] if a.ndim == 2 else Q.F32
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            a_round = dequantize(quantize(a, qtype), qtype).reshape(a.shape)
        elif qtype == Q.F16:
            a_round = a.astype(np.float16).astype(np.float32)
        else:
            a_round = a
        expected[name] = a_round
        stored = a
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n_head = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            stored = a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if qtype == Q.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(stored, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), stored.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(np.ascontiguousarray(stored), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_gguf_round_trip(tiny_checkpoint, tmp_path, arch):
    path, _ = tiny_checkpoint(arch)
    hf_cfg, state = load_hf_dir(path)
    state = {k: v for k, v in state.items() if not (hf_cfg.tie_word_embeddings and k == "lm_head.weight")}
    file = str(tmp_path / "tiny.gguf")
    expected = write_gguf(file, hf_cfg, state, [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32])
    cfg, got, _, blocks = load_gguf(file)
    for field in (
        "architecture",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "attention_bias",
        "qk_norm",
    ):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    assert cfg.rope_theta == pytest.approx(hf_cfg.rope_theta) and cfg.eos_token_ids == [2]
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert torch.equal(got[name], torch.from_numpy(ref)), name
    # the file's own blocks (kept for weight_format "gguf"): every 2-D tensor stored as q4_0 / q4_1 / q8_0, rows
    # un-permuted like the float tensors, standing for exactly those floats
    quantized_names = {n for n in expected if n in blocks}
    assert quantized_names and all(blocks[n].format in ("q4_0", "q4_1", "q8_0") for n in quantized_names)
    for name in quantized_names:
        assert torch.equal(dequantize_blocks(blocks[name]), got[name]), name


def _same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    """Bit for bit, any NaN matching any NaN (random bytes make NaN and inf scales too)."""
    got_bits, want_bits = got.numpy().view(np.uint32), want.reshape(-1).view(np.uint32)
    return bool(np.all((got_bits == want_bits) | (np.isnan(got.numpy()) & np.isnan(want.reshape(-1)))))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf's own NaN * 0
def test_block_dequantizer_gives_ggufs_bits():
    """dequantize_raw (the loader's whole-array dequantizer) against gguf's own, the format's definition: the
    default model's q8_0 embedding and first layer's q4_1 blocks, and random bytes in every format (every fp16
    scale and minimum a block can carry, NaN, inf and subnormal ones included)."""
    from prefixkv.model.gguf_file import GGUFFile
    from prefixkv.model.loader import default_model_path
    from prefixkv.model.quantized import BLOCK_BYTES, dequantize_raw

    tensors = GGUFFile(default_model_path()).tensors.values()
    real = [t for t in tensors if t.qtype == Q.Q8_0 or (t.name.startswith("blk.0.") and t.qtype == Q.Q4_1)]
    assert {t.qtype for t in real} == {Q.Q8_0, Q.Q4_1}
    for tensor in real:
        assert _same_bits(dequantize_raw(tensor.raw, tensor.qtype.name.lower()), dequantize(tensor.raw, tensor.qtype))
    rng = np.random.default_rng(0)
    for fmt, size in BLOCK_BYTES.items():
        raw = rng.integers(0, 256, size=(4096, size), dtype=np.uint8)
        assert _same_bits(dequantize_raw(raw, fmt), dequantize(raw, Q[fmt.upper()])), fmt
