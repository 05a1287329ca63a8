"""`prefixkv bench cache-invariance`: do greedy bf16 answers change when the prompt's KV comes from the cache?

The prompt set (`invariance_prompts`) mixes short questions, questions behind shared system prompts and the
turns of multi-turn chats. Every prompt is answered three ways, and the greedy tokens compared:
- cold: an engine with prefix caching off (nothing is ever reused);
- warm (partial hit): caching on, after the prompt's shared part (system prompt, earlier turns) was prewarmed;
- warm (full hit): the same prompts once more, so everything but the last token (or page) comes from the cache.
A prompt "flips" when a warm answer's greedy tokens differ from its cold ones; it "drifts" when any step's top
`--logprobs` log-probabilities differ by a bit while the tokens agree (the logits compared at every step, not only
their argmax). The distinct tokens per cold answer are reported, so a degenerate output (one token repeated) cannot
pass for agreement. `--sequential` sends one prompt at a time (only the
cache changes between cold and warm); the default sends the whole set at once, so the batches differ too. Batch
invariance is measured apart: `--alone N` prompts of mixed lengths answered one at a time against the cold batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass

from prefixkv.bench import common
from prefixkv.kvcache.radix_tree import common_prefix_len
from prefixkv.model import cpu_features

_SUBJECTS = [
    "the moon", "a bicycle", "photosynthesis", "the Roman empire", "volcanoes", "a compiler", "honey bees",
    "the ocean tides", "a violin", "glaciers", "the printing press", "electric cars", "coral reefs", "chess",
    "the human heart", "rainbows", "a lighthouse", "bread baking", "the internet", "owls",
]  # fmt: skip
_ASKS = [
    "Explain {s} to a child in two sentences.",
    "Give three facts about {s}.",
    "Write a short poem about {s}.",
    "What is the most surprising thing about {s}?",
    "Describe {s} in one paragraph.",
    "Why do people find {s} interesting?",
    "Compare {s} and {t} briefly.",
    "List two questions a student might ask about {s}.",
]
_SYSTEMS = [
    "You are a patient science teacher. Answer clearly, use simple words, and give one example for every idea.",
    "You are a travel guide for a small coastal town. You know its harbour, its lighthouse, its bakery and its "
    "history of fishing and trade. Keep answers friendly and short, and suggest something to visit when you can.",
    "You are a careful assistant for a software team. Prefer precise answers. When a question is ambiguous, say "
    "which reading you chose. Never invent APIs; if you are unsure, say so. Use plain text, no markdown tables.",
    "You are a museum audio guide. The museum has halls on ancient Egypt, medieval Europe, the age of sail and "
    "modern art. Speak as if the visitor stands in front of the exhibit, in three or four sentences, and end "
    "with a question that invites the visitor to look closer.",
]
_REPLIES = [
    "That is a good question. Here is a short answer.",
    "Sure. In short, it depends on the details, but the main idea is simple.",
    "Here are the key points, one by one.",
    "I would start with the basics and build from there.",
]


@dataclass(frozen=True)
class InvariancePrompt:
    kind: str  # "short" | "system" | "multi-turn"
    token_ids: list[int]
    shared_ids: list[int]  # the leading part other prompts share (prewarmed before the partial-hit run); may be []


def invariance_prompts(
    tokenizer, num_short: int = 40, num_system: int = 80, num_turns: int = 80, turns_per_chat: int = 10, seed: int = 0
) -> list[InvariancePrompt]:
    """A fixed, seeded set of chat prompts (token ids through the chat template): num_turns turns of chats of
    turns_per_chat turns each, every turn a prompt whose shared part is the turn before."""
    rng = random.Random(seed)

    def ask() -> str:
        s, t = rng.sample(_SUBJECTS, 2)
        return rng.choice(_ASKS).format(s=s, t=t)

    def ids(messages) -> list[int]:
        return tokenizer.encode_chat(messages, add_generation_prompt=True)

    prompts = [InvariancePrompt("short", ids([{"role": "user", "content": ask()}]), []) for _ in range(num_short)]
    for i in range(num_system):
        system = {"role": "system", "content": _SYSTEMS[i % len(_SYSTEMS)]}
        full = ids([system, {"role": "user", "content": ask()}])
        shared = tokenizer.encode_chat([system], add_generation_prompt=False)
        prompts.append(InvariancePrompt("system", full, full[: common_prefix_len(shared, full, 0, len(full))]))
    for c in range(-(-num_turns // turns_per_chat)):
        messages = [{"role": "system", "content": _SYSTEMS[c % len(_SYSTEMS)]}]
        previous: list[int] = []
        for _ in range(min(turns_per_chat, num_turns - c * turns_per_chat)):
            messages.append({"role": "user", "content": ask()})
            full = ids(messages)
            prompts.append(
                InvariancePrompt("multi-turn", full, full[: common_prefix_len(previous, full, 0, len(full))])
            )
            messages.append({"role": "assistant", "content": rng.choice(_REPLIES)})
            previous = full
    return prompts


def answer(llm, prompts: list[InvariancePrompt], max_tokens: int, sequential: bool, logprobs: int = 0) -> list:
    """Greedy outputs (RequestOutput) for every prompt, with each step's top `logprobs` log-probabilities: one
    batch, or one prompt at a time."""
    params = common.greedy(max_tokens)
    if logprobs:
        params = dataclasses.replace(params, logprobs=logprobs)
    ids = [list(p.token_ids) for p in prompts]
    if sequential:
        return [llm.generate([i], params, use_tqdm=False)[0] for i in ids]
    return llm.generate(ids, params, use_tqdm=False)


def warm_runs(
    llm, prompts: list[InvariancePrompt], max_tokens: int, sequential: bool, logprobs: int = 0
) -> dict[str, list]:
    """From an empty cache: prewarm the shared parts, answer (partial hits), answer again (full hits)."""
    llm.reset_prefix_cache()
    shared = sorted({tuple(p.shared_ids) for p in prompts if p.shared_ids})
    if shared:
        llm.prewarm([list(s) for s in shared])
    partial = answer(llm, prompts, max_tokens, sequential, logprobs)
    full = answer(llm, prompts, max_tokens, sequential, logprobs)
    return {"partial_hit": partial, "full_hit": full}


def flips(cold: list, warm: list) -> list[int]:
    """Indices of prompts whose warm greedy tokens differ from their cold ones."""
    return [i for i, (c, w) in enumerate(zip(cold, warm)) if c.outputs[0].token_ids != w.outputs[0].token_ids]


def step_logprobs(output) -> list:
    """Every step's (token, its log-probability, the top log-probabilities), exactly as the engine returned them."""
    return [(s.token_id, s.logprob, s.top_logprobs) for s in output.outputs[0].logprobs or []]


def drifts(cold: list, warm: list) -> list[int]:
    """Indices of prompts whose greedy tokens agree but some step's log-probabilities differ, by any bit."""
    return [
        i
        for i, (c, w) in enumerate(zip(cold, warm))
        if c.outputs[0].token_ids == w.outputs[0].token_ids and step_logprobs(c) != step_logprobs(w)
    ]


def distinct_tokens(outputs: list) -> dict:
    """Distinct tokens per answer (least and median): agreement between degenerate answers proves little."""
    counts = sorted(len(set(o.outputs[0].token_ids)) for o in outputs)
    return {"min": counts[0], "median": counts[len(counts) // 2]} if counts else {}


def spread_by_length(prompts: list[InvariancePrompt], n: int) -> list[int]:
    """Indices of n prompts spread evenly over the set sorted by length (short to long)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].token_ids))
    return [order[k * len(order) // n] for k in range(min(n, len(order)))]


def register(subparsers) -> None:
    p = subparsers.add_parser("cache-invariance", help="greedy answers cold vs after a cache hit (flip count)")
    p.add_argument("--num-short", type=int, default=40)
    p.add_argument("--num-system", type=int, default=80)
    p.add_argument("--num-turns", type=int, default=80)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--caches", default="hash,radix", help="comma-separated cache kinds to compare against off")
    p.add_argument("--sequential", action="store_true", help="one prompt at a time instead of the whole set")
    p.add_argument("--alone", type=int, default=32, help="prompts also answered alone, against the cold batch")
    p.add_argument("--logprobs", type=int, default=5, help="top log-probabilities compared at every step (0: none)")
    common.add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    factory = common.factory_for(args, llm_factory)
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    cold_llm = factory(prefix_cache="off")
    kernels_and_cpu = {"cpu": cpu_features.describe(), "kernels": dict(cold_llm.llm_engine.kernels)}
    prompts = invariance_prompts(
        cold_llm.get_tokenizer(), args.num_short, args.num_system, args.num_turns, seed=args.seed or 0
    )
    start = time.perf_counter()
    cold = answer(cold_llm, prompts, args.output_len, args.sequential, args.logprobs)
    results: dict = {"cold_s": time.perf_counter() - start, "distinct_tokens": distinct_tokens(cold), "caches": {}}
    rows = []
    if args.alone > 0 and not args.sequential:
        picked = spread_by_length(prompts, args.alone)
        alone = answer(cold_llm, [prompts[i] for i in picked], args.output_len, True, args.logprobs)
        flipped = [picked[k] for k in flips([cold[i] for i in picked], alone)]
        drifted = [picked[k] for k in drifts([cold[i] for i in picked], alone)]
        results["alone_vs_batch"] = {
            "prompts": picked,
            "flips": len(flipped),
            "flipped": flipped,
            "logprob_drifts": len(drifted),
            "drifted": drifted,
        }
        rows.append(["off", "alone vs batch", len(picked), 0, 0, len(flipped), len(drifted), ""])
    del cold_llm
    for cache in caches:
        llm = factory(prefix_cache=cache)
        start = time.perf_counter()
        warm = warm_runs(llm, prompts, args.output_len, args.sequential, args.logprobs)
        entry: dict = {"warm_s": time.perf_counter() - start}
        page_size = llm.llm_engine.kv.page_size
        for phase, outs in warm.items():
            flipped, drifted = flips(cold, outs), drifts(cold, outs)
            hit = sum(1 for o in outs if o.num_cached_tokens > 0)
            # all of the prompt but its last page: what a full hit must reuse
            near_full = sum(1 for o in outs if o.num_cached_tokens >= len(o.prompt_token_ids) - page_size)
            by_kind = {k: sum(1 for i in flipped if prompts[i].kind == k) for k in ("short", "system", "multi-turn")}
            entry[phase] = {
                "flips": len(flipped),
                "flipped": flipped,
                "by_kind": by_kind,
                "logprob_drifts": len(drifted),
                "drifted": drifted,
                "prompts_hit": hit,
                "prompts_hit_all_but_last_page": near_full,
                "cached_tokens": sum(o.num_cached_tokens for o in outs),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            }
            rows.append([cache, phase, len(prompts), hit, near_full, len(flipped), len(drifted), by_kind])
        results["caches"][cache] = entry
        del llm
    mode = "sequential" if args.sequential else "batched"
    common.print_table(
        ["cache", "run", "prompts", "hit", "hit all but the last page", "flips", "logprob drifts", "flips by kind"],
        rows,
        title=f"greedy {args.dtype} answers, cold (caching off) vs warm ({mode}); distinct tokens per answer "
        f"{results['distinct_tokens']}",
    )
    results["config"] = {
        **kernels_and_cpu,
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "logprobs": args.logprobs,
        "sequential": args.sequential,
        "dtype": args.dtype,
        "kernel_options": args.kernel_options,
        "page_size": args.page_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    return results
