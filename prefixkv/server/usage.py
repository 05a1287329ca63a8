"""The `usage` object, including how much of the prompt the prefix cache served and how much it wrote.

Prompt tokens, cached tokens and cache writes count once per prompt (n completions share one prefill);
completion tokens count every completion. A stream counts them as its delta outputs pass (UsageTally), so it
keeps numbers, not texts; a plain answer counts its final outputs the same way. `cache_write_tokens` (OpenAI's
field, in the openai SDK's PromptTokensDetails) is the engine's count of the prompt tokens the request inserted
into the prefix cache itself (RequestOutput.num_written_tokens), never a formula over the prompt and the hit.
"""

from __future__ import annotations

from prefixkv.cache_miss import CacheMiss
from prefixkv.outputs import RequestOutput


class UsageTally:
    def __init__(self, explain_cache_miss: bool = False) -> None:
        """explain_cache_miss: add prompt_tokens_details.cache_miss, why the prompt missed the cache (prefixkv's
        extension, asked for per request): one object, or a list in prompt order for several prompts."""
        self._prompts: dict[int, tuple[int, int, int]] = {}  # prompt index -> (prompt, cached, written tokens)
        self._misses: dict[int, CacheMiss] = {}
        self._explain = explain_cache_miss
        self._completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        """Count a delta (or final) output of prompt `prompt_index`; its newest cached and written counts hold."""
        cached = max(0, output.num_cached_tokens or 0)
        self._prompts[prompt_index] = (len(output.prompt_token_ids), cached, output.num_written_tokens)
        if output.cache_miss is not None:
            self._misses[prompt_index] = output.cache_miss
        self._completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def usage(self) -> dict:
        prompt = sum(p for p, _, _ in self._prompts.values())
        cached = sum(c for _, c, _ in self._prompts.values())
        written = sum(w for _, _, w in self._prompts.values())
        details: dict = {"cached_tokens": cached, "cache_write_tokens": written}
        if self._explain:
            misses = [self._misses[i].to_json() if i in self._misses else None for i in sorted(self._prompts)]
            details["cache_miss"] = misses[0] if len(misses) == 1 else misses
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self._completion_tokens,
            "total_tokens": prompt + self._completion_tokens,
            "prompt_tokens_details": details,
        }


def usage(finals: list[RequestOutput], explain_cache_miss: bool = False) -> dict:
    """`usage` of a plain (non-streamed) answer, from each prompt's final, whole output."""
    tally = UsageTally(explain_cache_miss)
    for prompt_index, output in enumerate(finals):
        tally.add(prompt_index, output)
    return tally.usage()
