"""Random-weight checkpoints in the shapes of real models, so kernels, invariance and speed are checked on the
shapes people serve (head_dim 128, GQA 2-6, q/k norms, q/k/v biases), not only on SmolLM2-135M's.

    prefixkv checkpoint --shape qwen3-0.6b --out /tmp/qwen3-0.6b           # the full shape (bf16 weights)
    prefixkv checkpoint --shape qwen3-0.6b --small --out /tmp/qwen3-small  # 2 layers, the same per-head shape

A checkpoint is a Hugging Face directory (config.json, model.safetensors, the tokenizer's files) that
`--model DIR` loads, and vLLM and transformers load too. Weights come from a seeded generator, initialised as
transformers' `_init_weights` does (linear and embedding weights normal(0, initializer_range), biases zero, norm
weights one), so activations have realistic scales. The tokenizer is the default model's (SmolLM2's, 49152
tokens): `vocab_size` is the tokenizer's, not the real model's (whose embedding is 2.6-3.1x larger), so every
token the model emits decodes; each record names both.

`--small` keeps what decides which kernel runs (head_dim, the query heads per kv head, q/k norms, biases, tied
embeddings, the rope type) and shrinks the rest (2 layers, 1-2 kv heads, a wider initializer_range so that
greedy answers vary): the suite's exactness and invariance checks run on those, the benchmarks on the full shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SEED = 0
# 2 layers initialised at the real 0.02 answer one token over and over; at 0.2 (as the suite's other tiny
# checkpoints) their greedy answers vary, so agreement between two paths means something
SMALL_INITIALIZER_RANGE = 0.2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One real model's shape: its config.json fields (without vocab_size, which is the tokenizer's)."""

    name: str
    source: str  # the real model whose config.json this copies
    real_vocab_size: int
    config: dict[str, Any]
    small_heads: tuple[int, int]  # (query heads, kv heads) of the small version: the same ratio
    small_hidden: int

    def hf_config(self, small: bool, vocab_size: int) -> dict[str, Any]:
        cfg = {**self.config, "vocab_size": vocab_size}
        if small:
            heads, kv = self.small_heads
            cfg.update(
                hidden_size=self.small_hidden,
                intermediate_size=2 * self.small_hidden,
                num_hidden_layers=2,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                max_position_embeddings=4096,
                initializer_range=SMALL_INITIALIZER_RANGE,
            )
        return cfg


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def _qwen(arch: str, hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int) -> dict[str, Any]:
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if arch == "qwen3":
        cfg["attention_bias"] = False
    return cfg


SHAPES = {
    s.name: s
    for s in (
        # head_dim 128 with per-head q/k norms; hidden 1024 but 16 x 128 = 2048 wide attention
        Shape("qwen3-0.6b", "Qwen/Qwen3-0.6B", 151936, _qwen("qwen3", 1024, 3072, 28, 16, 8, 128), (4, 2), 256),
        # head_dim 128, 3 query heads per kv head
        Shape("llama-3.2-3b", "meta-llama/Llama-3.2-3B", 128256, _llama(3072, 8192, 28, 24, 8), (6, 2), 768),
        # head_dim 128, q/k/v biases, 6 query heads per kv head
        Shape("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", 151936, _qwen("qwen2", 1536, 8960, 28, 12, 2, 128), (6, 1), 768),
        # head_dim 64 like SmolLM2, but 2048 wide and 4 query heads per kv head
        Shape("llama-3.2-1b", "meta-llama/Llama-3.2-1B", 128256, _llama(2048, 8192, 16, 32, 8), (8, 2), 512),
    )
}


def random_state(cfg: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors initialised as transformers' _init_weights does, drawn in float32 from one generator
    (the same seed gives the same weights in any dtype, up to its rounding)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    std = float(cfg["initializer_range"])
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_width = cfg["num_attention_heads"] * head_dim
    kv_width = cfg["num_key_value_heads"] * head_dim
    bias = cfg["model_type"] == "qwen2"
    state: dict[str, torch.Tensor] = {}

    def normal(name: str, *size: int) -> None:
        state[name] = torch.empty(size).normal_(0.0, std, generator=gen).to(dtype)

    def constant(name: str, value: float, size: int) -> None:
        state[name] = torch.full((size,), value, dtype=dtype)

    normal("model.embed_tokens.weight", cfg["vocab_size"], hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        constant(p + "input_layernorm.weight", 1.0, hidden)
        constant(p + "post_attention_layernorm.weight", 1.0, hidden)
        for proj, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            normal(p + f"self_attn.{proj}.weight", width, hidden)
            if bias:
                constant(p + f"self_attn.{proj}.bias", 0.0, width)
        normal(p + "self_attn.o_proj.weight", hidden, q_width)
        if cfg["model_type"] == "qwen3":
            constant(p + "self_attn.q_norm.weight", 1.0, head_dim)
            constant(p + "self_attn.k_norm.weight", 1.0, head_dim)
        normal(p + "mlp.gate_proj.weight", inter, hidden)
        normal(p + "mlp.up_proj.weight", inter, hidden)
        normal(p + "mlp.down_proj.weight", hidden, inter)
    constant("model.norm.weight", 1.0, hidden)
    if not cfg["tie_word_embeddings"]:
        normal("lm_head.weight", cfg["vocab_size"], hidden)
    return state


def default_tokenizer():
    """The default model's tokenizer (transformers), read from its GGUF."""
    from prefixkv.model.loader import default_model_path
    from prefixkv.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path(), "default").hf


def write_checkpoint(
    name: str,
    out: str,
    small: bool = False,
    seed: int = SEED,
    dtype: str | None = None,
    initializer_range: float | None = None,
) -> dict:
    """Write the checkpoint to `out` (created; an existing config.json there is a ValueError) and return what it
    is (model_record()). dtype: of the stored weights, bfloat16 for the full shapes and float32 for small ones unless
    given (the engine casts on load either way). initializer_range: the weights' std instead of the shape's (a full
    Qwen3 shape at the real 0.02 answers one or two tokens over and over; a wider one varies)."""
    import torch
    from safetensors.torch import save_file

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"{out} already holds a checkpoint (config.json); pick an empty folder")
    shape = SHAPES[name]
    tokenizer = default_tokenizer()
    cfg = shape.hf_config(small, vocab_size=len(tokenizer))
    if initializer_range is not None:
        if not initializer_range > 0:
            raise ValueError(f"initializer_range must be positive, got {initializer_range}")
        cfg["initializer_range"] = initializer_range
    cfg["bos_token_id"] = tokenizer.bos_token_id
    cfg["eos_token_id"] = tokenizer.eos_token_id
    cfg["prefixkv_shape"] = {"name": name, "small": small, "seed": seed}
    stored = dtype or ("float32" if small else "bfloat16")
    cfg["torch_dtype"] = stored
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(stored)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32 or bfloat16, got {stored!r}")
    os.makedirs(out, exist_ok=True)
    save_file(random_state(cfg, seed, torch_dtype), os.path.join(out, "model.safetensors"), {"format": "pt"})
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    return model_record(out)


def _copied_shape(hf_config: dict[str, Any]) -> dict[str, Any]:
    """For a checkpoint written here, which real model it copies and how (empty for any other model)."""
    written = hf_config.get("prefixkv_shape")
    if not isinstance(written, dict) or written.get("name") not in SHAPES:
        return {}
    shape = SHAPES[written["name"]]
    return {
        "shape": shape.name + ("-small" if written.get("small") else ""),
        "copies": shape.source,
        "random_weights_seed": written.get("seed", SEED),
        "initializer_range": hf_config.get("initializer_range"),
        "real_vocab_size": shape.real_vocab_size,
    }


def model_record(model: str | None) -> dict:
    """The shape of the model a benchmark ran (`--model`; None: the default), read from its config.json or GGUF
    header without loading weights; for a checkpoint written here, also the real model it copies."""
    from prefixkv.model.config import ModelConfig
    from prefixkv.model.gguf_file import GGUFFile
    from prefixkv.model.loader import default_model_path

    path = default_model_path() if model is None else os.path.expanduser(model)
    copied: dict[str, Any] = {}
    if os.path.isfile(path):
        gguf = GGUFFile(path)
        config = ModelConfig.from_gguf_metadata(gguf.metadata, has_output_weight="output.weight" in gguf.tensors)
    else:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf_config = json.load(f)
        config, copied = ModelConfig.from_hf_config(hf_config), _copied_shape(hf_config)
    record = {
        "model": os.path.basename(os.path.normpath(path)),
        "architecture": config.architecture,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "qk_norm": config.qk_norm,
        "vocab_size": config.vocab_size,
    }
    return {**record, **copied}


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="write a random-weight checkpoint in a real model's shape")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="an empty folder to write the Hugging Face checkpoint into")
    p.add_argument("--small", action="store_true", help="2 layers, the same per-head shape (the suite's size)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--initializer-range", type=float, default=None, help="the weights' std (default: the shape's)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    record = write_checkpoint(
        args.shape, args.out, args.small, args.seed, args.dtype, initializer_range=args.initializer_range
    )
    print(json.dumps(record, indent=2))
    return 0
