"""CompletionOutput.logprobs entries (a Sample per token: its id, logprob and top (id, logprob) alternatives) in
each API's shape: OpenAI's legacy completions one, its chat one (which Responses' output_text.logprobs reuses),
and Gemini's logprobsResult. Token strings are decoded one id at a time.
"""

from __future__ import annotations

from typing import Any

from prefixkv.batch import Sample


def _token_text(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id])
    except Exception:  # an id the tokenizer cannot render alone
        return f"<{token_id}>"


def _logprob(entry: Sample) -> float:
    return float(entry.logprob) if entry.logprob is not None else float("nan")


def completion_logprobs(tokenizer: Any, entries: list[Sample], text_offset: int) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the tokens in `entries`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        text = _token_text(tokenizer, e.token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(e))
        tops.append({_token_text(tokenizer, t): lp for t, lp in e.top_logprobs or []} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, entries: list[Sample]) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}; Responses' output_text.logprobs
    is the list."""

    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        c = item(e.token_id, _logprob(e))
        c["top_logprobs"] = [item(t, lp) for t, lp in e.top_logprobs or []]
        content.append(c)
    return {"content": content}


def gemini_logprobs(tokenizer: Any, entries: list[Sample], top: int) -> dict:
    """Gemini's logprobsResult: chosenCandidates (each token), topCandidates (its `top` alternatives, when asked)
    and logProbabilitySum."""

    def candidate(token_id: int, logprob: float) -> dict:
        return {"token": _token_text(tokenizer, token_id), "tokenId": token_id, "logProbability": logprob}

    out: dict = {
        "chosenCandidates": [candidate(e.token_id, _logprob(e)) for e in entries],
        "logProbabilitySum": sum(_logprob(e) for e in entries),
    }
    if top:
        out["topCandidates"] = [{"candidates": [candidate(t, lp) for t, lp in e.top_logprobs or []]} for e in entries]
    return out
