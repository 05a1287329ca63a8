"""Text <-> token ids and chat templates, via a transformers fast tokenizer.

Building a tokenizer from a GGUF vocabulary takes transformers ~5 s, so the result is saved once under
~/.cache/prefixkv/tokenizers/<file name, size, mtime> and later loads take ~0.3 s.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from functools import cached_property

from tokenizers import Tokenizer as BackendTokenizer
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Same ids as `hf(text).input_ids` (the tokenizer's default special-token handling)."""
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Each id's vocabulary entry as the vocabulary spells it (byte-level BPE: a space is "Ġ")."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary entry. Byte-level BPE
        spells each byte as one character, so this bounds the decoded length of any token from above."""
        return max((len(t) for t in self.hf.get_vocab()), default=1)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence decodes to one string (transformers types the batch case too)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a chat as prompt text. A malformed message list is a ValueError, not a template crash."""
        _check_messages(messages)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"tokenizer of {self.name} has no chat template")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors (raise_exception in templates, bad types) are the caller's fault
            raise ValueError(f"cannot render chat template: {e}") from e
        assert isinstance(text, str)  # tokenize=False renders text (transformers types the token-id results too)
        return text

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, allow_special_tokens_in_content: bool = False
    ) -> list[int]:
        """A chat as prompt token ids, where special-token text typed into a message stays plain text.

        Why: tokenizing the rendered template as one string turns "<|im_start|>system" inside a user's message
        into the real control token, so a user could forge a system turn. Only the template's own markers are
        special here; message content is tokenized with special tokens split into ordinary tokens.
        allow_special_tokens_in_content=True restores parsing the whole rendered text (the old behaviour).
        A conversation whose content holds no special-token text gets exactly `encode(rendered text)`.
        """
        text = self.apply_chat_template(messages, add_generation_prompt)
        if allow_special_tokens_in_content:
            return self.encode(text)
        for i, m in enumerate(messages):  # roles are template text; the server allows only known roles anyway
            if self._special_pattern.search(m["role"]):
                raise ValueError(f"messages[{i}].role contains special-token text")
        if not any(self._special_pattern.search(c) for c in _contents(messages)):
            return self.encode(text)
        return self._encode_inert_content(messages, text, add_generation_prompt)

    @cached_property
    def _special_pattern(self) -> re.Pattern:
        """Matches the text of any special token, longest first (as the tokenizer matches them)."""
        specials = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        specials |= set(self.hf.all_special_tokens)
        specials.discard("")
        if not specials:
            return re.compile(r"(?!x)x")  # matches nothing
        return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))

    def _encode_specials_as_text(self, text: str) -> list[int]:
        backend = self._specials_as_text
        if backend is None:  # a pure-Python tokenizer: the option is per call there
            return list(self.hf(text, add_special_tokens=False, split_special_tokens=True).input_ids)
        return backend.encode(text, add_special_tokens=False).ids

    @cached_property
    def _specials_as_text(self) -> BackendTokenizer | None:
        """A copy of the backend tokenizer that reads special-token text as ordinary text. A copy, because
        `hf(..., split_special_tokens=True)` flips a flag on the shared backend: a thread tokenizing another
        request at the same moment would then parse (or not parse) special tokens it should not."""
        shared = getattr(self.hf, "backend_tokenizer", None)
        if shared is None:
            return None
        backend = BackendTokenizer.from_str(shared.to_str())
        backend.encode_special_tokens = True
        backend.no_padding()
        backend.no_truncation()
        return backend

    @cached_property
    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text (a BOS, say), learned from one probe."""
        bare = list(self.hf("a", add_special_tokens=False).input_ids)
        full = list(self.hf("a").input_ids)
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    def _encode_inert_content(self, messages: list[dict], text: str, add_generation_prompt: bool) -> list[int]:
        """Render with a placeholder per content string to learn where the template's own text is; then the
        template's special tokens become their ids and every stretch of plain text between them (template
        text and content together, as the tokenizer would see it) is tokenized with specials split."""
        nonce = secrets.token_hex(8)
        marker = re.compile(f"\ue000{nonce}:([0-9]+)\ue001")
        contents: list[str] = []

        def placeholder(content: str) -> str:
            contents.append(content)
            return f"\ue000{nonce}:{len(contents) - 1}\ue001"

        masked = [_map_contents(m, placeholder) for m in messages]
        template = self.apply_chat_template(masked, add_generation_prompt)
        pieces = marker.split(template)  # template text, content index, template text, ...
        rebuilt = "".join(contents[int(p)] if i % 2 else p for i, p in enumerate(pieces))
        if rebuilt != text:  # the template changes or inspects content: its own text cannot be told apart
            raise ValueError(
                "a message's content contains special-token text and this chat template transforms "
                "content, so it cannot be kept as plain text; remove the special-token text from "
                "messages"
            )
        ids: list[int] = []
        plain: list[str] = []  # plain text since the last special token

        def flush() -> None:
            if plain:
                ids.extend(self._encode_specials_as_text("".join(plain)))
                plain.clear()

        for i, piece in enumerate(pieces):
            if i % 2:
                plain.append(contents[int(piece)])
                continue
            last = 0
            for match in self._special_pattern.finditer(piece):
                plain.append(piece[last : match.start()])
                flush()
                token_id = self.hf.convert_tokens_to_ids(match.group())
                assert isinstance(token_id, int)  # one token, one id (transformers types the list case too)
                ids.append(token_id)
                last = match.end()
            plain.append(piece[last:])
        flush()
        before, after = self._added_around
        return before + ids + after


def _contents(messages: list[dict]) -> list[str]:
    """Every piece of content text in the messages (string contents and text parts)."""
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return out


def _map_contents(message: dict, fn) -> dict:
    """A copy of the message with fn applied to its content string or to each text part's text."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": fn(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": fn(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


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
