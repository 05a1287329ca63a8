"""Prewarming: compute and cache prompts' KV without generating, so the first real request with that prefix is
a cache hit (a long system prompt, a shared document). Used by LLM.prewarm and `prefixkv serve --prewarm FILE`;
POST /v1/cache/prewarm (server/prewarm.py) submits the same prefill-only requests through the server's engine.

A prewarm is an engine request with prefill_only set: the scheduler computes its prompt like any other (chunked,
sharing what is cached already), nothing is sampled, and it finishes once its prompt's KV is committed, so every
full page of the prompt stays cached (until evicted, or as retained as its retention says). No model package
here: the engine loop does the work.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefixkv.engine.engine import Engine
from prefixkv.kvcache.retention import PROMPT_CACHE_RETENTION
from prefixkv.request_options import NO_RETENTION, RequestOptions, Retention
from prefixkv.sampling_params import SamplingParams

# what a prewarm request asks of the sampler: nothing is sampled, but add_request checks one token would fit
PREWARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def is_conversation(item: Any) -> bool:
    return isinstance(item, list) and bool(item) and all(isinstance(m, dict) and "role" in m for m in item)


def engine_prompt(engine: Engine, item: Any) -> str | list[int] | dict:
    """A prompt as add_request takes it, from a string, token ids, an engine prompt dict, or chat messages (a
    list of {"role", "content"} dicts, templated with the generation prompt as a chat request would be)."""
    if is_conversation(item):
        ids = engine.tokenizer.encode_chat(item, add_generation_prompt=True)
        return {"prompt_token_ids": ids}
    return item


def prewarm(
    engine: Engine,
    prompts: Sequence[str | list[int] | dict],
    *,
    cache_salt: str | None = None,
    retention: Retention = NO_RETENTION,
) -> list[int]:
    """Compute and cache each prompt; returns, per prompt, its tokens now cached (whole pages). All or nothing
    on bad input: a ValueError leaves no request queued. Drives engine.step() itself: call it on an engine no
    other loop is stepping (offline, or before a server starts)."""
    options = RequestOptions(PREWARM_PARAMS, cache_salt=cache_salt, retention=retention, prefill_only=True)
    ids: list[str] = []
    try:
        for prompt in prompts:
            ids.append(engine.add_request(None, prompt, options))
    except ValueError:
        for rid in ids:
            engine.abort(rid)
        raise
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
    return [engine.cached_prompt_tokens(prompt, cache_salt) for prompt in prompts]


def read_prewarm_file(path: str) -> list[tuple[int, dict]]:
    """`serve --prewarm FILE`: one JSON object per line with "prompt" (text or token ids) or "messages", and
    optionally "cache_salt" and "prompt_cache_retention"; blank lines are skipped. Returns (line number,
    object) pairs; ValueError naming the line."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
            unknown = set(item) - {"prompt", "messages", "cache_salt", "prompt_cache_retention"}
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
            if ("prompt" in item) == ("messages" in item):
                raise ValueError(f"{where}: needs exactly one of 'prompt' and 'messages'")
            prompt = item.get("prompt")
            if "prompt" in item and not (
                (isinstance(prompt, str) and prompt)
                or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
            ):
                raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
            messages = item.get("messages")
            if "messages" in item and not (
                isinstance(messages, list)
                and messages
                and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
            ):
                raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
            if not isinstance(item.get("cache_salt", ""), str):
                raise ValueError(f"{where}: 'cache_salt' must be a string")
            if item.get("prompt_cache_retention", "in_memory") not in PROMPT_CACHE_RETENTION:
                raise ValueError(f"{where}: 'prompt_cache_retention' must be one of {sorted(PROMPT_CACHE_RETENTION)}")
            items.append((lineno, item))
    return items


def prewarm_from_file(engine: Engine, path: str) -> tuple[int, int]:
    """Warm every line of a prewarm file (checked in full first); returns (prompts, cached tokens)."""
    items = read_prewarm_file(path)
    total = 0
    for lineno, item in items:
        prompt = engine_prompt(engine, item["messages"] if "messages" in item else item["prompt"])
        retention = PROMPT_CACHE_RETENTION[item.get("prompt_cache_retention", "in_memory")]
        try:
            (cached,) = prewarm(engine, [prompt], cache_salt=item.get("cache_salt"), retention=retention)
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
        total += cached
    return len(items), total
