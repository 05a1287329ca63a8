"""Loader and tokenizer: errors name the problem, the GGUF q/k un-permutation, tokenizer behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from prefixkv.model.gguf_loader import hf_name, unpermute_rotary
from prefixkv.model.loader import _name_from_path, load_model


@pytest.mark.parametrize("name", ["no-such-model", "/nonexistent/path/model.gguf"])
def test_unknown_model_is_value_error(name):
    with pytest.raises(ValueError, match="unknown model"):
        load_model(name)


def test_bad_dtype_and_non_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        load_model(None, dtype="int3")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        load_model(str(f))
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # llama.cpp convert_hf_to_gguf: reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rotary(permuted, n_head), w)


def test_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None
    assert _name_from_path("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert _name_from_path("/x/my-model/") == "my-model"


def test_default_model(smol):
    c = smol.config
    assert smol.name == "SmolLM2-135M-Instruct"
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert c.tie_word_embeddings and c.vocab_size == 49152
    assert 2 in smol.tokenizer.eos_token_ids


def test_tokenizer(smol):
    tok = smol.tokenizer
    assert tok.encode("Hello world") == tok.hf("Hello world").input_ids
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "Hi" in text
    assert tok.decode(tok.encode(text)) != text  # special tokens are skipped by default
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": 3}], ["x"]):
        with pytest.raises(ValueError):
            tok.apply_chat_template(bad)


def test_tokenizer_cache_is_optional(monkeypatch, tmp_path):
    """With HOME pointing to an empty (or unwritable) place the GGUF tokenizer still loads, and is cached."""
    from prefixkv.model import tokenizer as tkmod
    from prefixkv.model.loader import default_model_path

    monkeypatch.setattr(tkmod, "_cache_root", lambda: str(tmp_path / "missing" / "cache"))
    tok = tkmod.Tokenizer.from_gguf(default_model_path(), "x")
    assert tok.encode("Hello world") == [19556, 905]
    assert (tmp_path / "missing" / "cache").is_dir()


def test_hf_dir_chat_template_from_either_file(tiny_checkpoint, tmp_path, smol):
    """HF dirs keep the chat template in chat_template.jinja (new) or tokenizer_config.json (old)."""
    import json
    import os
    import shutil

    from prefixkv.model.tokenizer import Tokenizer

    src, _ = tiny_checkpoint("qwen3")
    expected = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert load_model(src).tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == expected
    old = tmp_path / "old_style"
    shutil.copytree(src, old)
    template = (old / "chat_template.jinja").read_text()
    os.remove(old / "chat_template.jinja")
    cfg = json.loads((old / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (old / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(str(old), "old")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == expected
