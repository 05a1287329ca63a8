"""Pick next tokens from logits: greedy (exact argmax) or temperature / top-k / top-p / min-p sampling.

Seeded requests draw from a generator seeded by (seed, num_output_tokens), so a request gets the same tokens
whatever batch it lands in and after preemption. Unseeded requests share one runner-wide generator.
Random draws use the exponential-race trick (argmax of p / Exp(1) noise == a multinomial draw) so each row
needs only one noise vector from its own generator; everything else is batched.
"""

from __future__ import annotations

import torch

from prefixkv.batch import Sample
from prefixkv.model.penalties import apply_penalties
from prefixkv.sampling_params import SamplingParams

_MASK_SEED = (1 << 63) - 1


def seeded_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator that depends only on the request's seed and how many tokens it has produced."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK_SEED
    return torch.Generator(device="cpu").manual_seed(mixed)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        histories: list[tuple[list[int], int] | None] | None = None,
    ) -> list[Sample]:
        """logits: fp32 [N, vocab], one row per sampling request; histories: each penalized row's tokens so far
        and its prompt's length (penalties.py). Logprobs are of the logits after the grammar mask, logit_bias and
        the penalties, before temperature (vLLM's "processed_logprobs")."""
        n = logits.shape[0]
        logits = apply_penalties(logits, params, histories or [None] * n)
        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(logits, params, num_output_tokens, greedy)
        ids = token_ids.tolist()
        samples = [Sample(token_id=t) for t in ids]
        want = [i for i in range(n) if params[i].logprobs is not None]
        if want:
            self._add_logprobs(logits, want, token_ids, params, samples)
        return samples

    def _sample(self, logits, params, num_output_tokens, greedy) -> torch.Tensor:
        device = logits.device
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, g in enumerate(greedy) if not g]
        idx = torch.tensor(rows, device=device)
        x = logits.index_select(0, idx)
        temps = torch.tensor([params[i].temperature for i in rows], device=device, dtype=x.dtype)
        x = x / temps[:, None]
        vocab = x.shape[-1]

        top_ks = [params[i].top_k if params[i].top_k > 0 else vocab for i in rows]
        if any(k < vocab for k in top_ks):
            k_max = max(k for k in top_ks if k < vocab)
            top_vals = x.topk(k_max, dim=-1).values
            k_idx = torch.tensor([min(k, k_max) - 1 for k in top_ks], device=device)
            thresh = top_vals.gather(1, k_idx[:, None])
            thresh[torch.tensor([k >= vocab for k in top_ks], device=device)] = float("-inf")
            x = x.masked_fill(x < thresh, float("-inf"))

        top_ps = torch.tensor([params[i].top_p for i in rows], device=device, dtype=x.dtype)
        if bool((top_ps < 1).any()):
            sorted_x, order = x.sort(dim=-1, descending=True)
            sorted_p = sorted_x.softmax(dim=-1)
            # drop a token when the tokens strictly before it already reach top_p (the first always stays)
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_ps[:, None]
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))

        probs = x.softmax(dim=-1)
        min_ps = torch.tensor([params[i].min_p for i in rows], device=device, dtype=x.dtype)
        if bool((min_ps > 0).any()):
            floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)

        noise = torch.empty(len(rows), vocab)
        for j, i in enumerate(rows):
            p = params[i]
            gen = self.generator if p.seed is None else seeded_generator(p.seed, num_output_tokens[i])
            noise[j].exponential_(generator=gen)
        noise.clamp_(min=1e-30)  # never 0: 0/0 would be NaN, which argmax treats as the maximum
        picked = (probs / noise.to(device)).argmax(dim=-1)
        return token_ids.index_copy(0, idx, picked)

    @staticmethod
    def _add_logprobs(logits, want, token_ids, params, samples) -> None:
        idx = torch.tensor(want, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
        chosen = logp.gather(1, token_ids.index_select(0, idx)[:, None])[:, 0].tolist()
        k_max = max(params[i].logprobs for i in want)
        top = logp.topk(k_max, dim=-1) if k_max > 0 else None
        for j, i in enumerate(want):
            samples[i].logprob = chosen[j]
            k = params[i].logprobs
            if top is None or k == 0:
                samples[i].top_logprobs = []
            else:
                samples[i].top_logprobs = list(zip(top.indices[j, :k].tolist(), top.values[j, :k].tolist()))
