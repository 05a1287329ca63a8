"""Exact softmax merge of attention pieces computed over disjoint key sets.

Attention over keys A + B equals a weighted sum of attention over A and attention over B, with weights from each
piece's log-sum-exp of scores. Cascade decodes (shared prefix once + own suffix) and split prefill chunks (cached
context + own tokens) are built on this; the merge runs in float32 whatever the model dtype. It changes the
summation order against one call over all keys, which is why the options use it only below float32.
"""

from __future__ import annotations

import torch


def merge_by_lse(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Normalised pieces o_i with log-sum-exp lse_i (broadcastable) -> sum_i o_i * exp(lse_i - lse), in dtype."""
    lse = torch.logaddexp(lse1, lse2)
    return o1.float().mul_((lse1 - lse).exp_()).add_(o2.float().mul_((lse2 - lse).exp_())).to(dtype)


def merge_unnormalised(
    m1: torch.Tensor, l1: torch.Tensor, o1: torch.Tensor, m2: torch.Tensor, l2: torch.Tensor, o2: torch.Tensor
) -> torch.Tensor:
    """Float32 pieces as running max m, sum of exp l and unnormalised output o (p @ v) -> the normalised output."""
    m = torch.maximum(m1, m2)
    a1, a2 = (m1 - m).exp_(), (m2 - m).exp_()
    return (o1 * a1).add_(o2 * a2).div_((l1 * a1).add_(l2 * a2))
