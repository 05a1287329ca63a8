"""The few numbers that define a decoder, independent of where the weights came from (HF dir or GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF `model_type` / GGUF `general.architecture` -> our architecture name.
_ARCH_ALIASES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Qwen2 adds qkv bias, Qwen3 adds per-head q/k RMSNorm."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed config.json (and optionally generation_config.json, which may list more eos ids)."""
        model_type = cfg.get("model_type", "")
        arch = _ARCH_ALIASES.get(model_type)
        if arch is None:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; supported: {sorted(_ARCH_ALIASES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos: list[int] = []
        for source in (cfg, generation_config or {}):
            value = source.get("eos_token_id")
            for tok in value if isinstance(value, list) else [value]:
                if isinstance(tok, int) and tok not in eos:
                    eos.append(tok)
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 may nest both under rope_parameters.
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        """Build from GGUF key/values (`llama.block_count`, ...). Tied embeddings = no `output.weight` tensor."""
        gguf_arch = meta.get("general.architecture", "")
        arch = _ARCH_ALIASES.get(gguf_arch)
        if arch is None:
            raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(_ARCH_ALIASES)}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{gguf_arch}.{name}", default)

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_kv_heads = int(key("attention.head_count_kv", num_heads))
        head_dim = int(key("attention.key_length", hidden // num_heads))
        rope_scaling = None
        scaling_type = key("rope.scaling.type")
        if scaling_type in ("linear", "yarn"):
            rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}
            if scaling_type == "yarn":
                rope_scaling["original_max_position_embeddings"] = int(
                    key("rope.scaling.original_context_length", key("context_length", 2048))
                )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab_size = key("vocab_size")
        if vocab_size is None:
            vocab_size = len(meta.get("tokenizer.ggml.tokens", []))
        return cls(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(key("feed_forward_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )
