"""Model-test fixtures: the default SmolLM2 (ours and Hugging Face's reference load) and tiny random checkpoints.

Everything expensive is loaded once: our loads are the session's shared ones (tests/conftest.py), HF's own GGUF
load (~25 s) once per module that needs it.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(2)

CHAT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
RAW_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time,",
    (
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
        "    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\ndef is_prime(n):\n"
    ),
]


@pytest.fixture(scope="session")
def smol(loaded_model):
    """Our fp32 load of the default model (the one the engines in other test directories share)."""
    return loaded_model("float32")


@pytest.fixture(scope="session")
def smol_bf16(loaded_model):
    """Our bf16 load of the default model: the session's, which the bf16 engines of the engine, bench and kvcache
    tests (run before these) have loaded already; a load of its own would be a second copy in memory."""
    return loaded_model("bfloat16")


@pytest.fixture(scope="session")
def smol_prompts(smol) -> list[list[int]]:
    tok = smol.tokenizer
    return [tok.encode(tok.apply_chat_template(CHAT_PROMPT))] + [tok.encode(p) for p in RAW_PROMPTS]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) with eos disabled, so it always produces max_new_tokens tokens."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory, smol) -> str:
    """The SmolLM2 tokenizer saved as a plain HF tokenizer, to pair with tiny random checkpoints."""
    path = str(tmp_path_factory.mktemp("smol_tokenizer"))
    smol.tokenizer.hf.save_pretrained(path)
    return path


def _tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": None,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, rope_parameters=rope)
    if arch == "llama-linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_parameters=rope)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "qwen2-yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
        return Qwen2Config(**common, rope_parameters=rope)
    if arch == "qwen3":
        # explicit head_dim different from hidden / heads, as in real Qwen3 checkpoints
        return Qwen3Config(
            **{**common, "tie_word_embeddings": True},
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, smol_tokenizer_dir):
    """tiny_checkpoint(arch) -> (dir, HF model): a random 2-layer checkpoint saved with save_pretrained."""
    import shutil

    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def make(arch: str):
        if arch not in cache:
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32).eval()
            if arch.startswith("qwen2"):  # random init leaves biases at zero; make them matter
                with torch.no_grad():
                    for layer in hf.model.layers:
                        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                            proj.bias.normal_(0, 0.5)
            path = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
            hf.save_pretrained(path)
            for f in os.listdir(smol_tokenizer_dir):
                shutil.copy(os.path.join(smol_tokenizer_dir, f), path)
            cache[arch] = (path, hf)
        return cache[arch]

    return make
