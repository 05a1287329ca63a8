"""Turn a stream's engine outputs into per-choice increments.

The engine sends a stream per-step deltas (see async_engine.py): each holds only the text, token ids and
logprobs new since the request's previous output, and lists only the completions that changed. So the
increment is the delta's own text; what is kept per choice is a count (characters sent, for the logprobs'
text offsets), never the text. Choice index = prompt number * n + completion index, as OpenAI numbers the
choices of a multi-prompt request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from prefixkv.batch import Sample
from prefixkv.server.async_engine import RequestGroup
from prefixkv.server.usage import UsageTally


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[Sample]  # the new tokens' logprobs (empty when not requested)
    text_offset: int  # characters of this choice sent before `text`
    finish_reason: str | None
    stop_reason: str | int | None


async def choice_deltas(group: RequestGroup, n: int, tally: UsageTally) -> AsyncIterator[ChoiceDelta]:
    """Yield each non-empty increment and, once per choice, its finish. Counts usage in `tally` as outputs pass.

    A token whose text is not visible yet (an incomplete character, or text a stop string may still cut) comes
    with an empty text: its logprobs wait for the next increment of that choice."""
    sent_chars: dict[int, int] = {}
    pending_logprobs: dict[int, list[Sample]] = {}
    finished: set[int] = set()
    async for prompt_index, output in group:
        tally.add(prompt_index, output)
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            if index in finished:
                continue
            logprobs = pending_logprobs.pop(index, []) + list(completion.logprobs or [])
            done = completion.finish_reason is not None
            if not completion.text and not done:
                if logprobs:
                    pending_logprobs[index] = logprobs
                continue
            chars = sent_chars.get(index, 0)
            sent_chars[index] = chars + len(completion.text)
            if done:
                finished.add(index)
            yield ChoiceDelta(
                index,
                completion.text,
                logprobs,
                chars,
                completion.finish_reason,
                completion.stop_reason if done else None,
            )
