"""What a second agent turn may read from the cache of the first: the first turn's prompt and the call it
answered with, as far as they were computed.

The last sampled token never ran forward, and with jump-forward (on by default) neither did the tokens the
grammar forced after it when they closed the call: the request ends on them. So the second turn's hit reaches
past every full page of the first prompt into the answer, and at most to the last full page of what was computed.
"""

from __future__ import annotations


def assert_reads_into_the_first_answer(cached: int, prompt_tokens: int, output_tokens: int, page: int) -> None:
    computed_at_most = prompt_tokens + output_tokens - 1
    assert prompt_tokens // page * page < cached <= computed_at_most // page * page, (
        cached,
        prompt_tokens,
        output_tokens,
    )
