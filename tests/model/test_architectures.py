"""Tiny random Llama / Qwen2 / Qwen3 checkpoints: fp32 greedy must equal HF generate token for token,
whatever the page size, page order or prefill chunking."""

from __future__ import annotations

import pytest

from prefixkv.model.loader import load_model
from prefixkv.model.runner import ModelRunner
from tests.model.conftest import hf_greedy
from tests.model.helpers import greedy_generate

NEW_TOKENS = 24
PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 17, 9046, 1232, 44, 1006, 2342, 30, 339, 3543, 5248, 57]


@pytest.mark.parametrize(
    "arch, page_size, chunk",
    [
        ("llama", 16, None),  # llama3 rope scaling
        ("llama", 1, 5),  # radix-style pages, chunked prefill (start_pos > 0)
        ("llama-linear", 3, 8),  # linear rope, tied embeddings, odd page size
        ("qwen2", 16, 7),  # qkv bias
        ("qwen2-yarn", 2, 10),  # yarn rope (attention scaling), context past original_max_position_embeddings
        ("qwen3", 4, None),  # q/k norm, explicit head_dim
        ("qwen3", 1, 6),
    ],
)
def test_tiny_matches_hf(tiny_checkpoint, arch, page_size, chunk):
    path, hf = tiny_checkpoint(arch)
    expected = hf_greedy(hf, PROMPT, NEW_TOKENS)
    loaded = load_model(path)
    assert loaded.config.architecture == arch.split("-")[0]
    runner = ModelRunner(loaded, num_pages=(len(PROMPT) + NEW_TOKENS) // page_size + 8, page_size=page_size)
    got = greedy_generate(runner, PROMPT, NEW_TOKENS, chunk=chunk, shuffle_seed=page_size)
    assert got == expected


def test_config_from_hf_dir(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    cfg = load_model(path).config
    assert (cfg.qk_norm, cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings) == (True, 32, 2, True)
    path, _ = tiny_checkpoint("qwen2")
    assert load_model(path).config.attention_bias
