"""KernelOptions: which kernel runs each piece of the forward pass, chosen once when the runner starts.

Every choice the model and the attention planner make about *how* to compute (never *what*) lives here, in one
frozen object built from the device, the dtype, what the native module compiled and explicit overrides. Nothing
below the runner checks the device or reads a module global to pick a path: the planner turns the options into
row groups once per step, and the model's fused / packed switches are set from them once (`LlamaModel.use_kernels`).

Two kinds of paths, and why the defaults differ by dtype:
- bit-exact ones (oneDNN's packed weights, in-place native decodes, fused elementwise ops): they compute what
  the plain ops compute, so they are on wherever they can run;
- reordering ones (cascade decodes, split prefill, shared-prefix prefill): they merge softmax pieces by
  log-sum-exp, which changes the floating-point summation order. float32 must give token-identical output with
  prefix caching on and off, so they are on only below float32;
- the native bf16 attention kernel (native_attention) and matrix products (matmul "avx512_bf16" / "amx") round
  differently from torch's SDPA and oneDNN (their error on random inputs is within torch's own,
  tests/model/test_native_attention.py, test_gemm.py); they exist for bfloat16 only.
- cache_invariant (bf16, on wherever the native kernels run): every row is computed by one arithmetic whatever
  the cache, the chunking or the batch: decodes run the prefill kernel's reduction order, shared prefixes hand
  their softmax state over to each member's own keys instead of merging by log-sum-exp, and every matrix product
  runs prefixkv's own kernel (matmul "avx512_bf16" or "amx"), whose rows never depend on the row count, instead
  of oneDNN, whose kernel choice does. Greedy bf16 answers then do not change on a cache hit, nor in a batch
  (tests/engine/test_cache_invariance.py).
- matmul: which kernel computes the matrix products (prefixkv.model.matmul): the fastest row-invariant one when
  cache_invariant is on, oneDNN with packed weights when it is off, F.linear for float32 and on GPUs.

Tests parametrize these options (`dataclasses.replace(options, in_place_decodes=False)`) instead of patching.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from prefixkv.choices import WEIGHT_FORMATS
from prefixkv.model import matmul, native
from prefixkv.model.config import ModelConfig

# torch's CPU flash-attention kernel that also returns each row's log-sum-exp (what SDPA runs on CPU); the
# attention groups call it where `flash_lse` is set
FLASH_WITH_LSE: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """How the forward pass computes; see the module docstring. Build with `KernelOptions.choose`."""

    # decodes outside cascade groups are attended by the native kernel straight from their pages (else they are
    # gathered into padded length groups for SDPA)
    in_place_decodes: bool = False
    # decodes whose page tables start with the same pages attend to that shared prefix once per group
    cascade_decodes: bool = False
    # a prefill chunk after cached tokens attends to the cached part and to its own K/V in two merged calls
    split_prefill: bool = False
    # merged pieces come from torch's CPU flash kernel with log-sum-exp (else: float32 reference ops for cascade
    # groups, one masked call for split chunks)
    flash_lse: bool = False
    # prefill chunks attend with the native bf16 kernel (prefixkv.model.native.flash_attention: K/V read from the
    # pool by slot, no gather, no GQA expansion), and cascade decodes attend to their shared prefix with it
    native_attention: bool = False
    # the native attention kernels compute their two products on AMX tiles instead of AVX512_BF16 dot products
    # (needs native_attention and a CPU whose AMX attention passed its own self-test, see native.amx_attention;
    # matmul "amx" has a self-test of its own, native.amx_gemm)
    amx_attention: bool = False
    # prefill chunks behind the same cached leading pages attend to that prefix once, stacked (needs
    # native_attention; reorders the softmax sum like cascade decodes)
    shared_prefill: bool = False
    # bf16 rows are computed the same whether their context is cached or fresh, however the step was cut and
    # batched: decodes use the prefill kernel's arithmetic (paged_flash_decode), shared-prefix groups (cut at a
    # multiple of 64 keys) continue each row's softmax state instead of merging by log-sum-exp, and matrix products
    # run a kernel whose rows never depend on the batch (needs native_attention, in_place_decodes and a matmul in
    # matmul.ROW_INVARIANT_PATHS)
    cache_invariant: bool = False
    # RMSNorm, rotary embedding and SiLU-multiply use the native one-pass bf16 kernels
    fused_ops: bool = False
    # a step whose rows are all in-place decodes runs the decoder layers in one native call (csrc/decode_layers.cpp:
    # the same kernels in the same order as the Python layers, so the same bits, without the interpreter between
    # them; needs cache_invariant and fused_ops)
    fused_decode: bool = False
    # which kernel computes the matrix products: "torch" (F.linear), "onednn" (weights packed once into oneDNN's
    # blocked layout), "avx512_bf16" or "amx" (prefixkv's row-invariant kernels); see prefixkv.model.matmul
    matmul: str = "torch"
    # how the matmul weights are read (prefixkv.model.quantized): "dense" (the weights in the model's dtype, by
    # `matmul`'s kernel), "gguf" (the checkpoint's own q8_0 / q4_0 / q4_1 blocks where it has them) or "q8_0" (every
    # matmul weight quantized at load); block formats run the native qgemm kernel, row-invariant like `matmul`'s
    weight_format: str = "dense"
    # padded decode groups: a group closes where the next context is longer than group_growth times the group's
    # shortest and than min_split_len (below that, padding is cheaper than another SDPA call per layer)
    group_growth: float = 2.0
    min_split_len: int = 256
    # a cascade group needs >= cascade_min_members members sharing >= cascade_min_prefix leading tokens (whole
    # pages), and must gather at most cascade_max_gather of the slots its members would gather alone (suffixes are
    # padded). With native in-place decodes a member reads its pages where they lie, so a cascade saves only the
    # packing of the shared prefix, once instead of once per member, and costs a second kernel call: measured on
    # SmolLM2 (1024-token prefixes, bf16, 2 threads) it pays from 12-16 members (8: 1.04x slower, 16: 1.09x faster,
    # 32: 1.2x faster), hence 12 with native attention and 2 for gathered decodes
    cascade_min_members: int = 2
    cascade_min_prefix: int = 64
    cascade_max_gather: float = 0.75

    @staticmethod
    def choose(
        device: torch.device | str, dtype: torch.dtype, config: ModelConfig | None = None, **overrides
    ) -> KernelOptions:
        """The defaults for this device, dtype and model shape, with `overrides` (field=value) applied.

        An override asking for a path that cannot run here (e.g. fused_ops on float32) is a ValueError.
        """
        device = torch.device(device)
        cpu = device.type == "cpu"
        below_fp32 = dtype in (torch.bfloat16, torch.float16)
        native_attention = cpu and dtype == torch.bfloat16 and native_attention_fits(config)
        options = KernelOptions(
            in_place_decodes=cpu and native.module() is not None,
            cascade_decodes=below_fp32,
            split_prefill=below_fp32,
            flash_lse=cpu and FLASH_WITH_LSE is not None,
            native_attention=native_attention,
            cascade_min_members=12 if native_attention else 2,
            amx_attention=native_attention and native.amx_attention() is not None,
            shared_prefill=native_attention,
            fused_ops=cpu
            and dtype == torch.bfloat16
            and native.fused_ops() is not None
            and (config is None or fused_ops_fit(config)),
            matmul=matmul.best_row_invariant(device, dtype) or _library_matmul(device, dtype),
        )
        fields = {f.name: f for f in dataclasses.fields(KernelOptions)}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ValueError(f"unknown kernel options {sorted(unknown)}")
        for name, value in overrides.items():
            kind = {"bool": bool, "str": str}.get(str(fields[name].type))
            if kind is not None and type(value) is not kind:
                raise ValueError(f"kernel option {name} takes a {kind.__name__}, got {value!r}")
        if overrides.get("weight_format", "dense") not in WEIGHT_FORMATS:
            got, formats = overrides["weight_format"], ", ".join(WEIGHT_FORMATS)
            raise ValueError(f"kernel option weight_format must be one of {formats}, got {got!r}")
        if overrides.get("matmul", "torch") not in matmul.PATHS:
            paths = ", ".join(matmul.PATHS)
            raise ValueError(f"kernel option matmul must be one of {paths}, got {overrides['matmul']!r}")
        options = dataclasses.replace(options, **overrides)
        if "amx_attention" not in overrides:  # follows native_attention when an override turned that off
            options = dataclasses.replace(options, amx_attention=options.amx_attention and options.native_attention)
        if "cache_invariant" not in overrides:  # on wherever its kernels run, also when an override turned them off
            kernels = options.native_attention and options.in_place_decodes
            options = dataclasses.replace(
                options, cache_invariant=kernels and options.matmul in matmul.ROW_INVARIANT_PATHS
            )
        if not options.cache_invariant and "matmul" not in overrides:  # oneDNN where row invariance is not asked
            options = dataclasses.replace(options, matmul=_library_matmul(device, dtype))
        if "fused_decode" not in overrides:  # on wherever the kernels it calls run
            options = dataclasses.replace(
                options, fused_decode=options.cache_invariant and options.fused_ops and fused_decode_fits()
            )
        options.check(device, dtype, config)
        return options

    def check(self, device: torch.device | str, dtype: torch.dtype, config: ModelConfig | None = None) -> None:
        """Raise ValueError naming the first option that cannot run on this device / dtype / model shape."""
        device = torch.device(device)
        cpu = device.type == "cpu"
        if self.in_place_decodes and not (cpu and native.module() is not None):
            raise ValueError("in_place_decodes needs the native CPU kernels (prefixkv.model.native)")
        if self.flash_lse and not (cpu and FLASH_WITH_LSE is not None):
            raise ValueError("flash_lse needs torch's CPU flash-attention kernel")
        if self.native_attention and not (cpu and dtype == torch.bfloat16 and native_attention_fits(config)):
            raise ValueError(
                "native_attention needs bfloat16, head_dim 64 or 128 and a CPU with AVX-512 BF16 or AVX2 + FMA "
                "(native build)"
            )
        if self.shared_prefill and not self.native_attention:
            raise ValueError("shared_prefill needs native_attention")
        if self.amx_attention and not (self.native_attention and native.amx_attention() is not None):
            raise ValueError(
                f"amx_attention needs native_attention and the AMX attention kernels ({native.amx_status('attention')})"
            )
        if self.cache_invariant and not (
            self.native_attention and self.in_place_decodes and self.matmul in matmul.ROW_INVARIANT_PATHS
        ):
            raise ValueError(
                "cache_invariant needs native_attention, in_place_decodes and a row-invariant matmul "
                f"({' or '.join(matmul.ROW_INVARIANT_PATHS)})"
            )
        if self.fused_ops and not (cpu and dtype == torch.bfloat16 and native.fused_ops() is not None):
            raise ValueError("fused_ops needs bfloat16 on a CPU where the native fused kernels are built")
        if self.fused_ops and config is not None and not fused_ops_fit(config):
            raise ValueError("fused_ops needs hidden and intermediate sizes divisible by 16 and head_dim by 32")
        if self.fused_decode and not (self.cache_invariant and self.fused_ops and fused_decode_fits()):
            raise ValueError("fused_decode needs cache_invariant, fused_ops and the native decode loop")
        if self.weight_format != "dense" and not (cpu and dtype == torch.bfloat16 and native.qgemm() is not None):
            raise ValueError(
                f"weight_format {self.weight_format} needs bfloat16 on a CPU with AVX-512 and the native qgemm kernel "
                "(the activations stay bf16)"
            )
        if self.matmul not in matmul.available(device, dtype):
            raise ValueError(
                f"matmul {self.matmul!r} cannot run here ({dtype} on {device.type}); available: "
                f"{', '.join(matmul.available(device, dtype))} (oneDNN needs bf16 support, avx512_bf16 the native "
                "build on an AVX-512 BF16 CPU, avx2 that build on a CPU without AVX-512 for bf16 and on any "
                "AVX2 + FMA CPU for float32, amx a CPU with AMX tiles)"
            )

    @property
    def isa_path(self) -> str:
        """Which instruction set prefixkv's own kernels run on: "amx", "avx512_bf16", "avx2" (a CPU without
        AVX-512), or "torch" (none of ours: torch's and oneDNN's kernels only)."""
        if self.matmul == "amx" or self.amx_attention:
            return "amx"
        if self.native_attention:
            return native.attention_isa()
        if self.matmul in ("avx512_bf16", "avx2"):
            return self.matmul
        return "torch"


def _library_matmul(device: torch.device, dtype: torch.dtype) -> str:
    """The matmul when invariance is not asked: oneDNN with packed weights where it runs (a CPU with bf16
    instructions), else prefixkv's AVX2 kernel where that is what is compiled (torch only emulates bf16 there),
    else F.linear."""
    paths = matmul.available(device, dtype)
    return "onednn" if "onednn" in paths else "avx2" if "avx2" in paths else "torch"


NATIVE_HEAD_DIMS = (64, 128)


def native_attention_fits(config: ModelConfig | None) -> bool:
    """The native attention kernels are built for this CPU (AVX-512 BF16 or AVX2 + FMA) and the model's head_dim
    (64 or 128: one build of the kernels each)."""
    return native.flash_attention() is not None and (config is None or config.head_dim in NATIVE_HEAD_DIMS)


def fused_ops_fit(config: ModelConfig) -> bool:
    """The native elementwise kernels cover these widths only."""
    return config.hidden_size % 16 == 0 and config.intermediate_size % 16 == 0 and config.head_dim % 32 == 0


def fused_decode_fits() -> bool:
    """The native decode loop is built (it covers every layer the native attention and fused ops fit, per-head
    q/k norms included)."""
    return native.decode_layers() is not None
