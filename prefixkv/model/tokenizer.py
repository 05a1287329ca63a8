"""Text <-> token ids and chat templates, via a transformers fast tokenizer.

Building a tokenizer from a GGUF vocabulary takes transformers ~5 s, so the result is saved once under
~/.cache/prefixkv/tokenizers/<file name, size, mtime> and later loads take ~0.3 s.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def _cache_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "prefixkv", "tokenizers")


def _gguf_cache_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.basename(path)}-{st.st_size}-{st.st_mtime_ns}"


def _load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    cached = os.path.join(_cache_root(), _gguf_cache_key(path))
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # noqa: BLE001 - a corrupt cache entry must never stop a load; rebuild it below
            shutil.rmtree(cached, ignore_errors=True)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    try:
        os.makedirs(_cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=_cache_root(), prefix=".tmp-")
        hf.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic: concurrent loaders never see a half-written entry
    except OSError:
        pass  # read-only home or a racing writer: the cache is only an optimisation
    return hf


class Tokenizer:
    """What the engine needs from a tokenizer; `.hf` is the underlying transformers tokenizer."""

    def __init__(self, hf: PreTrainedTokenizerBase, name: str, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        self.name = name
        eos = {int(t) for t in extra_eos_token_ids}
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: set[int] = eos

    @classmethod
    def from_gguf(cls, path: str, name: str, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        return cls(_load_gguf_tokenizer(path), name, extra_eos_token_ids)

    @classmethod
    def from_hf_dir(cls, path: str, name: str, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (chat template there or in chat_template.jinja)."""
        return cls(AutoTokenizer.from_pretrained(path), name, extra_eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Same ids as `hf(text).input_ids` (the tokenizer's default special-token handling)."""
        return list(self.hf(text).input_ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a chat as prompt text. A malformed message list is a ValueError, not a template crash."""
        _check_messages(messages)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"tokenizer of {self.name} has no chat template")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors (raise_exception in templates, bad types) are the caller's fault
            raise ValueError(f"cannot render chat template: {e}") from e
        return text


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")  # noqa: TRY004 (API error)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}")
        elif not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"messages[{i}] needs a string 'content'")
