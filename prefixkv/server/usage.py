"""The `usage` object, including how much of the prompt the prefix cache served.

Prompt tokens and cached tokens count once per prompt (n completions share one prefill); completion tokens
count every completion.
"""
from __future__ import annotations

from prefixkv.outputs import RequestOutput


def usage(outputs: list[RequestOutput | None]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    cached = sum(max(0, o.num_cached_tokens or 0) for o in outputs if o is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
