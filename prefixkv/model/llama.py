"""The Llama-family decoder (Llama, Qwen2 = qkv bias, Qwen3 = per-head q/k RMSNorm) over a paged KV pool.

Tokens of all batch items are flattened into one [T] row axis, so every matmul runs once per layer for the
whole step. q/k/v and gate/up projections are fused into single matmuls. The lm_head is separate
(`compute_logits`) so the runner applies it only to rows that sample.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.model import matmul, native, quantized
from prefixkv.model.attention import StepPlan, paged_attention
from prefixkv.model.config import ModelConfig
from prefixkv.model.options import KernelOptions
from prefixkv.model.quantized import QuantizedBlocks
from prefixkv.model.rope import RotaryEmbedding, apply_rotary


class Linear(nn.Module):
    """nn.Linear without random init: weights always come from a checkpoint, and init costs seconds."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: matmul.PackedWeight | None = None  # the weight as options.matmul reads it, set by use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear(x, self.weight, self.packed, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Normalise in fp32 and scale after casting back, exactly as Hugging Face does.

    F.rms_norm without a weight computes x * rsqrt(mean(x^2) + eps) with the same ops as Hugging Face's
    Python code (bit-identical results), in one call that is 3.5x faster on 2048 rows.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    fused: ModuleType | None = None  # the native module when its one-pass bf16 kernels are in use (set by use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2:
            return self.fused.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.fused: ModuleType | None = None  # the native module when its one-pass bf16 kernels run (use_kernels)

    def forward(self, x, cos, sin, kv_layer, plan: StepPlan) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:  # q and k heads are adjacent columns: rotate them in one pass
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
            qk = apply_rotary(qk, cos, sin) if self.fused is None else self.fused.rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:  # per-head norms (Qwen3) on rows of head_dim, then q and k heads rotated in one pass
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.head_dim))
            qk = torch.cat((q, k.view(t, self.num_kv_heads, self.head_dim)), dim=1)
            qk = apply_rotary(qk, cos, sin) if self.fused is None else self.fused.rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        kv = torch.stack((k, v), dim=1)  # [T, 2, KVH, d]: one index_copy_ writes both
        out = paged_attention(q, kv, kv_layer, plan, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused: ModuleType | None = None  # the native module when its one-pass bf16 kernels run (use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, kv_layer, plan):
        """h is updated in place (the model owns it: it starts as a fresh embedding lookup)."""
        h.add_(self.self_attn(self.input_layernorm(h), cos, sin, kv_layer, plan))
        return h.add_(self.mlp(self.post_attention_layernorm(h)))


class LlamaModel(nn.Module):
    """Decoder stack. The runner binds the KV pool with `bind_kv_cache` before the first forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.kv_cache: torch.Tensor | None = None  # [layers, 2, kv_heads, slots, head_dim]
        self.lm_head_packed: matmul.PackedWeight | None = None  # as Linear.packed, for the lm_head
        self.fused_decode: Any = None  # native DecodeLayers over the packed weights, when options.fused_decode
        self.file_blocks: dict[str, QuantizedBlocks] = {}  # the checkpoint's own quantized blocks, by weight name
        self.kernel_options: KernelOptions | None = None  # what use_kernels last set up

    def use_kernels(self, options: KernelOptions) -> None:
        """Set the fused-ops and matmul switches of every module from the runner's options, in one place.

        Matmul: every weight gets the copy options.matmul reads (oneDNN's blocked layout or prefixkv's panels, see
        prefixkv.model.matmul; none for F.linear), or with options.weight_format its blocks in the layout qgemm
        reads (the checkpoint's own, kept by keep_file_blocks, or q8_0 made here). The plain weights stay (a
        LoadedModel may be shared by several runners): packing costs one more copy of the matmul weights in memory.
        The runner calls this after any dtype/device change, so a packed copy never outlives its weight. Fused ops:
        RMSNorm, rotary embedding and SiLU-multiply run the native one-pass bf16 kernels (prefixkv.model.native)
        instead of torch's ops; options.check has made sure they fit the shapes.
        """
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.packed = self._packed(name + ".weight", module.weight, options)
        lm_name = "embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        self.lm_head_packed = self._packed(lm_name, self._lm_weight(), options)
        kernels = native.fused_ops() if options.fused_ops else None
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = kernels
        self.fused_decode = self._decode_layers(options) if options.fused_decode else None
        self.kernel_options = options

    def _packed(self, name: str, weight: torch.Tensor, options: KernelOptions) -> matmul.PackedWeight | None:
        """The copy of a matmul weight the forward pass reads: in options.weight_format's blocks, else for
        options.matmul's kernel."""
        if options.weight_format == "q8_0":
            return matmul.pack_quantized(quantized.quantize_q8_0(weight))
        if options.weight_format == "gguf" and name in self.file_blocks:
            return matmul.pack_quantized(self.file_blocks[name])
        return matmul.pack(weight, options.matmul)

    def _decode_layers(self, options: KernelOptions) -> Any:
        """The native one-call decoder loop over this model's packed weights (options.fused_decode)."""
        return native.module().DecodeLayers(**self.decode_layers_arguments(options))

    def decode_layers_arguments(self, options: KernelOptions) -> dict[str, Any]:
        """What the native DecodeLayers is built from: the layers' packed weights, their formats and the shapes
        (also for scripts/ab_decode_layers.py, which builds it from two builds of the kernels)."""
        c = self.config

        def packed(linear: Linear) -> torch.Tensor:
            assert linear.packed is not None and linear.packed.path in (*matmul.ROW_INVARIANT_PATHS, *quantized.FORMATS)
            return linear.packed.data

        def block_format(linear: Linear) -> str:
            """The weight's block format, "" for the dense bf16 panels"""
            assert linear.packed is not None
            return linear.packed.path if linear.packed.path in quantized.FORMATS else ""

        def norm_weight(norm: RMSNorm | None) -> torch.Tensor | None:
            return None if norm is None else norm.weight

        layers = cast(list[DecoderLayer], list(self.layers))
        matrices = [
            [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
            for layer in layers
        ]
        return dict(
            input_norm=[layer.input_layernorm.weight for layer in layers],
            qkv=[packed(layer.self_attn.qkv_proj) for layer in layers],
            qkv_bias=[layer.self_attn.qkv_proj.bias for layer in layers],
            q_norm=[norm_weight(layer.self_attn.q_norm) for layer in layers],
            k_norm=[norm_weight(layer.self_attn.k_norm) for layer in layers],
            o=[packed(layer.self_attn.o_proj) for layer in layers],
            post_norm=[layer.post_attention_layernorm.weight for layer in layers],
            gate_up=[packed(layer.mlp.gate_up_proj) for layer in layers],
            down=[packed(layer.mlp.down_proj) for layer in layers],
            formats=[[block_format(m) for m in four] for four in matrices],
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            eps=c.rms_norm_eps,
            amx=options.matmul == "amx",
        )

    def _lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """input_ids, positions: [T] (all batch items flattened) -> final-normed hidden states [T, hidden]."""
        if self.kv_cache is None:
            raise RuntimeError("bind_kv_cache() must be called before forward()")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        decodes = plan.only_invariant_decodes() if self.fused_decode is not None else None
        if decodes is not None:  # the same kernels as the layers below, in one native call
            scale = self.config.head_dim**-0.5  # every layer's Attention.scale
            h = self.fused_decode.run(
                h, cos, sin, self.kv_cache, plan.slot_mapping, decodes.page_table, decodes.context_lens,
                decodes.page_size, scale, decodes.isa,
            )  # fmt: skip
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, self.kv_cache[i], plan)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]; call only on rows that sample."""
        return matmul.linear(hidden, self._lm_weight(), self.lm_head_packed, None).float()

    def keep_file_blocks(self, blocks: dict[str, QuantizedBlocks]) -> None:
        """Keep the checkpoint's own quantized blocks (HF names, as load_gguf returns them) by this model's weight
        names, fused as load_weights fuses the float weights; weight_format "gguf" packs them (use_kernels)."""
        fused: dict[str, QuantizedBlocks | None] = {}
        if "model.embed_tokens.weight" in blocks:
            fused["embed_tokens.weight"] = blocks["model.embed_tokens.weight"]
        if "lm_head.weight" in blocks and self.lm_head is not None:
            fused["lm_head.weight"] = blocks["lm_head.weight"]

        def stacked(names: list[str]) -> QuantizedBlocks | None:
            found = [blocks[name] for name in names if name in blocks]
            return quantized.concat_rows(found) if len(found) == len(names) else None

        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for fused_name, names in (
                ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                ("self_attn.o_proj", ("self_attn.o_proj",)),
                ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                ("mlp.down_proj", ("mlp.down_proj",)),
            ):
                fused[f"{dst}{fused_name}.weight"] = stacked([f"{src}{name}.weight" for name in names])
        self.file_blocks = {name: b for name, b in fused.items() if b is not None}

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Missing or unexpected weights are errors."""
        state = dict(state)
        params = dict(self.named_parameters())

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint is missing weight {name}")
            return state.pop(name)

        def put(name: str, value: torch.Tensor) -> None:
            p = params.pop(name)
            if p.shape != value.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)} != model {tuple(p.shape)}")
            p.data = value.to(p.dtype).contiguous()  # adopt the storage: no copy of a 500 MB model

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        else:
            state.pop("lm_head.weight", None)  # tied checkpoints sometimes store a copy
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", take(src + "post_attention_layernorm.weight"))
            qkv = [take(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
            put(dst + "self_attn.qkv_proj.weight", torch.cat(qkv, dim=0))
            if self.config.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat([take(f"{src}self_attn.{p}_proj.bias") for p in "qkv"]))
            put(dst + "self_attn.o_proj.weight", take(src + "self_attn.o_proj.weight"))
            if self.config.qk_norm:
                put(dst + "self_attn.q_norm.weight", take(src + "self_attn.q_norm.weight"))
                put(dst + "self_attn.k_norm.weight", take(src + "self_attn.k_norm.weight"))
            gate_up = [take(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
            put(dst + "mlp.gate_up_proj.weight", torch.cat(gate_up, dim=0))
            put(dst + "mlp.down_proj.weight", take(src + "mlp.down_proj.weight"))
        leftover = [k for k in state if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"checkpoint has unexpected weights, e.g. {leftover[:3]}")
        if params:
            raise ValueError(f"weights never loaded: {sorted(params)[:3]}")
