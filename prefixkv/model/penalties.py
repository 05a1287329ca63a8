"""Logit bias and the presence / frequency / repetition penalties, applied to the logits before sampling.

Each row is changed by its own request's settings and tokens only, with elementwise operations, so a penalized
answer is the same alone or in any batch. A logit the grammar set to -inf stays -inf under every change here
(a finite bias added, a positive factor, a finite penalty subtracted). Definitions follow vLLM's: frequency and
presence count the output's tokens, repetition the prompt's and the output's.
"""

from __future__ import annotations

import torch

from prefixkv.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[tuple[list[int], int] | None]
) -> torch.Tensor:
    """logits: fp32 [N, vocab]; histories[i]: row i's tokens so far and how many are its prompt's (None when
    row i sets no penalty). Returns the logits changed (a copy) or the same tensor when no row asks."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or histories[i] is not None]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p, row = params[i], out[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device))
        history = histories[i]
        if history is None:
            continue
        tokens, num_prompt = history
        if p.repetition_penalty != 1.0 and tokens:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(tokens, dtype=torch.long, device=row.device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        output = tokens[num_prompt:]
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab]
            counts = counts.to(device=row.device, dtype=row.dtype)
            row.sub_(p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype))
    return out
