"""Turn cumulative engine outputs into per-choice increments for streaming.

The engine reports, per step, the whole text so far of each completion (it only grows), so the increment is
the text past what was already sent. Choice index = prompt number * n + completion index, as OpenAI numbers
the choices of a multi-prompt request.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from prefixkv.outputs import RequestOutput
from prefixkv.server.async_engine import RequestGroup


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[dict]  # engine logprob entries of the new tokens (empty when not requested)
    text_offset: int  # characters of this choice sent before `text`
    finish_reason: str | None
    stop_reason: str | int | None


async def choice_deltas(group: RequestGroup, n: int, finals: list[RequestOutput | None]) -> AsyncIterator[ChoiceDelta]:
    """Yield each non-empty increment and, once per choice, its finish. Fills `finals` as outputs arrive."""
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    async for prompt_index, output in group:
        finals[prompt_index] = output
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            if index in finished:
                continue
            chars, tokens = sent_chars.get(index, 0), sent_tokens.get(index, 0)
            text = completion.text[chars:]
            new_logprobs = list((completion.logprobs or [])[tokens:])
            done = completion.finish_reason is not None
            if not text and not done:
                continue
            sent_chars[index] = len(completion.text)
            sent_tokens[index] = tokens + len(new_logprobs)
            if done:
                finished.add(index)
            yield ChoiceDelta(index, text, new_logprobs, chars, completion.finish_reason,
                              completion.stop_reason if done else None)
