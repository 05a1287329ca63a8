"""A request's prompt as the engine takes it: parsed (text, token ids, or a dict that also names its namespace)
and checked against the model and the pool before anything is queued. Every problem is a ValueError that names
it (the server turns it into a 400)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixkv.engine.client import EngineTokenizer, Prompt
from prefixkv.request import MultiModalHash
from prefixkv.sampling_params import SamplingParams

_PROMPT_FIELDS = {"prompt", "prompt_token_ids", "cache_salt", "lora_id", "adapter_id", "multi_modal_hashes"}


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    text: str | None  # the prompt's text, when it came as text
    token_ids: list[int]
    cache_salt: str | None  # the namespace (tenant) its KV is cached under
    lora_id: str | None
    mm_hashes: tuple[MultiModalHash, ...]


def parse_prompt(
    prompt: Prompt,
    tokenizer: EngineTokenizer,
    vocab_size: int,
    cache_salt: str | None = None,
    lora_id: str | None = None,
    mm_hashes: Iterable | None = None,
) -> ParsedPrompt:
    """Text (tokenized here), token ids, or a dict with "prompt" or "prompt_token_ids" and optionally the
    namespace fields, which win over the keyword arguments."""
    text = None
    token_ids: list[int] | None
    if isinstance(prompt, dict):
        unknown = set(prompt) - _PROMPT_FIELDS
        if unknown:
            raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
        cache_salt = prompt.get("cache_salt", cache_salt)
        lora_id = prompt.get("lora_id", prompt.get("adapter_id", lora_id))
        mm_hashes = prompt.get("multi_modal_hashes", mm_hashes)
        if "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif "prompt" in prompt:
            text = prompt["prompt"]
            token_ids = None
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        token_ids = list(prompt)
    else:
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    if token_ids is None:
        if not isinstance(text, str):
            raise ValueError("prompt must be a string")
        token_ids = tokenizer.encode(text)
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if not token_ids:
        raise ValueError("the prompt is empty")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError("cache_salt must be a string")
    mm = tuple(m if isinstance(m, MultiModalHash) else MultiModalHash(*m) for m in (mm_hashes or ()))
    return ParsedPrompt(text, list(token_ids), cache_salt, None if lora_id is None else str(lora_id), mm)


def max_tokens_for(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, pool_tokens: int) -> int:
    """The tokens the request may generate (params.max_tokens, or what the context leaves, or with
    clamp_max_tokens the smaller of the two); ValueError when the prompt leaves none, or prompt plus output exceed
    the context or the KV pool."""
    n = num_prompt_tokens
    if n >= max_model_len:
        raise ValueError(
            f"the prompt has {n} tokens but the model's context length (max_model_len) is "
            f"{max_model_len}; at least one token must be left to generate"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if params.clamp_max_tokens:
        max_tokens = max(1, min(max_tokens, max_model_len - n, pool_tokens - n))
    if n + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={max_tokens} with a {n}-token prompt exceeds max_model_len="
            f"{max_model_len}; ask for at most {max_model_len - n} tokens"
        )
    if n + max_tokens > pool_tokens:
        raise ValueError(
            f"prompt plus max_tokens ({n + max_tokens} tokens) cannot fit the KV cache ({pool_tokens} tokens)"
        )
    return max_tokens


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids a and b have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
