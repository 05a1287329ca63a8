"""Hugging Face checkpoint directory (config.json + *.safetensors) -> (ModelConfig, HF-named tensors)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_dir(path: str):
    """Read config.json (+ generation_config.json) and every *.safetensors shard. Tensors keep HF names."""
    from prefixkv.model.config import ModelConfig

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no config.json; not a Hugging Face model directory")
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    config = ModelConfig.from_hf_config(_read_json(config_path), gen)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(os.path.join(path, shard)))
    return config, state
