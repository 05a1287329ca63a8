"""What the engine keeps of each request between steps, and the RequestOutput it makes of it.

A client's request with n > 1 is fanned out into n sibling Requests (they share the prompt's pages through the
prefix cache): one SequenceState per scheduled Request (its text so far, stop reason, logprobs, what earlier
outputs carried) under one ParentRequest, merged back into one RequestOutput by `build_output`, whole or as the
delta since the previous output (RequestOutputKind).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixkv.batch import Sample
from prefixkv.engine.constraints import ConstrainedOutput
from prefixkv.engine.detokenizer import IncrementalDetokenizer
from prefixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from prefixkv.request import Request


@dataclass(eq=False, slots=True)
class SequenceState:
    """Engine-side state of one generated sequence: the scheduled Request plus its text."""

    request: Request
    parent_id: str
    index: int
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Sample] | None = None
    cumulative_logprob: float = 0.0
    constraint: ConstrainedOutput | None = None  # structured outputs: its grammar's matcher (engine/constraints.py)
    # what earlier outputs carried (output_kind="delta" sends only what came after)
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finished: bool = False


@dataclass(eq=False, slots=True)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


def build_output(parent: ParentRequest) -> RequestOutput:
    """The parent's output now: every sibling whole, or (delta) what each sibling added since the last one."""
    delta = parent.output_kind is RequestOutputKind.DELTA
    completions = []
    for seq in parent.sequences:
        req = seq.request
        tokens = req.output_token_ids
        if not delta:
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detok.text,
                    token_ids=tokens,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=None if seq.logprobs is None else list(seq.logprobs),
                    cumulative_logprob=None if seq.logprobs is None else seq.cumulative_logprob,
                )
            )
            continue
        finished_now = seq.finish_reason is not None and not seq.sent_finished
        if len(tokens) == seq.sent_tokens and not finished_now:
            continue  # nothing new for this sibling
        text = seq.detok.text
        shown = len(text) if seq.finish_reason is not None else max(seq.sent_text, len(text) - seq.detok.holdback)
        completions.append(
            CompletionOutput(
                index=seq.index,
                text=text[seq.sent_text : shown],
                token_ids=tokens[seq.sent_tokens :],
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=None if seq.logprobs is None else seq.logprobs[seq.sent_tokens :],
                cumulative_logprob=None if seq.logprobs is None else seq.cumulative_logprob,
            )
        )
        seq.sent_tokens, seq.sent_text = len(tokens), shown
        seq.sent_finished = seq.finish_reason is not None
    reqs = [s.request for s in parent.sequences]
    first = reqs[0]
    finished = all(seq.finish_reason is not None for seq in parent.sequences)
    metrics = RequestMetrics(
        arrival_time=parent.arrival_time,
        first_scheduled_time=min((r.first_scheduled_time for r in reqs if r.first_scheduled_time), default=None),
        first_token_time=min((r.first_token_time for r in reqs if r.first_token_time), default=None),
        finish_time=max((r.finish_time or 0 for r in reqs), default=None) if finished else None,
    )
    writes = first.cache_writes
    for r in reqs[1:]:  # siblings share the prompt: whichever computed a page first wrote it
        writes = writes.union(r.cache_writes)
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=max(first.num_cached_tokens, 0),
        cache_writes=writes,
        metrics=metrics,
        cache_miss=first.cache_miss,
    )
