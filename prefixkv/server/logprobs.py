"""CompletionOutput.logprobs entries ({"token_id", "logprob", "top_logprobs": [(id, lp), ...]}) in the two
shapes OpenAI uses: the legacy completions one and the chat one. Token strings are decoded one id at a time.
"""

from __future__ import annotations

from typing import Any


def _token_text(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id])
    except Exception:  # an id the tokenizer cannot render alone
        return f"<{token_id}>"


def _top(entry: dict) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for t, lp in (entry.get("top_logprobs") or [])]


def completion_logprobs(tokenizer: Any, entries: list[dict], text_offset: int) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the tokens in `entries`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        text = _token_text(tokenizer, int(e["token_id"]))
        tokens.append(text)
        token_logprobs.append(float(e["logprob"]))
        tops.append({_token_text(tokenizer, t): lp for t, lp in _top(e)} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, entries: list[dict]) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        c = item(int(e["token_id"]), float(e["logprob"]))
        c["top_logprobs"] = [item(t, lp) for t, lp in _top(e)]
        content.append(c)
    return {"content": content}
