"""`prefixkv bench weight-formats`: what reading the weights in fewer bytes buys and costs (issue 26).

For each weight format (dense bf16, the GGUF's own blocks, q8_0 made at load) on the same machine, in one process:
- speed: decode tok/s of 1 and 16 streams (bench decode's measure: a 50-token question, 128 greedy tokens),
  the formats timed in rounds that rotate their order, medians; against dense, the median of the per-round ratios
  (each round's runs seconds apart), every round's listed with what the rounds show;
- quality: on a fixed set of chat prompts, greedy answers of 64 tokens, the share of positions where a format's
  token equals the reference's (and how many answers are identical), against dense bf16 and against a float32
  engine (--reference-dtype: the checkpoint's values unrounded, the closest to what the file means); and
  perplexity on a fixed text (docs/data/perplexity_text.txt), every token scored in one prefill.
What it does not show: that answers are right. For the shipped GGUF, dense bf16 is the file's q4_1 values rounded
to bf16 while "gguf" reads them exactly, so a greedy answer that differs from bf16 may be the closer one to float32.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.decode import timed_streams
from prefixkv.bench.paired import paired
from prefixkv.bench.workloads import median, random_prompts, ratio, sampler_for

FORMATS = ("dense", "gguf", "q8_0")
TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "data", "perplexity_text.txt")
QUALITY_PROMPTS = [
    "What is the capital of France, and why is it famous?",
    "Explain in two sentences how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "List three uses of a paperclip other than holding paper.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a Python function that reverses a string.",
    "What are the main differences between a cat and a dog as pets?",
    "Describe the water cycle for a ten-year-old.",
    "Suggest a name for a bakery that only sells bread.",
    "How does a bicycle stay upright when it moves?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a prime number is and give five examples.",
]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "weight-formats", help="decode speed and quality (greedy agreement, perplexity) of dense vs quantized weights"
    )
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats to compare")
    p.add_argument("--input-len", type=int, default=50, help="prompt tokens per decode stream")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per decode stream")
    p.add_argument("--streams", default="1,16", help="comma-separated stream counts")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; medians reported")
    p.add_argument("--answer-tokens", type=int, default=64, help="greedy tokens per quality prompt")
    p.add_argument("--num-prompts", type=int, default=len(QUALITY_PROMPTS), help="quality prompts used (of 16)")
    p.add_argument(
        "--reference-dtype", default="float32", help="dtype of the dense reference engine for quality ('' for none)"
    )
    common.add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16")


def perplexity(llm, token_ids: list[int]) -> dict[str, float]:
    """exp(mean negative log-likelihood) of every token of the text after the first, from one prefill's logits."""
    import torch

    runner: Any = llm.llm_engine.runner
    n = len(token_ids)
    pages = -(-n // runner.page_size)
    if pages > runner.num_pages:
        raise ValueError(f"the text ({n} tokens) does not fit the KV pool ({runner.num_pages} pages)")
    llm.reset_prefix_cache()
    kv = llm.llm_engine.kv
    if kv.num_used_pages() or kv.num_cached_pages():  # the scoring pass writes pages 0.. behind the cache's back
        raise ValueError("perplexity needs an idle engine: no request running and nothing cached (or retained)")
    with torch.inference_mode():
        plan = runner.planner.plan([n], [0], [list(range(pages))])
        ids = torch.tensor(token_ids, dtype=torch.long)
        hidden = runner.model(ids, torch.arange(n), plan)
        logits = runner.model.compute_logits(hidden[:-1])
        nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean").item()
    return {"tokens_scored": n - 1, "mean_nll": nll, "perplexity": math.exp(nll)}


def agreement(reference: list[list[int]], answers: list[list[int]]) -> dict[str, float]:
    """Share of positions with the reference's token, and of answers identical to the reference's."""
    same = sum(a == b for ref, ans in zip(reference, answers) for a, b in zip(ref, ans))
    total = sum(max(len(ref), len(ans)) for ref, ans in zip(reference, answers))
    identical = sum(ref == ans for ref, ans in zip(reference, answers))
    pairs = list(zip(reference, answers))
    first = [next((i for i, (a, b) in enumerate(zip(ref, ans)) if a != b), len(ref)) for ref, ans in pairs]
    return {
        "token_agreement": ratio(same, total),
        "identical_answers": identical,
        "answers": len(reference),
        "mean_tokens_before_first_difference": sum(first) / max(len(first), 1),
    }


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict[str, Any]:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if "dense" not in formats:
        formats.insert(0, "dense")
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    factory = common.factory_for(args, llm_factory)
    llms = {fmt: factory(prefix_cache=args.prefix_cache, weight_format=fmt) for fmt in formats}
    sampler = sampler_for(llms["dense"], seed=args.seed)
    decode_prompts = {n: random_prompts(sampler, n, args.input_len) for n in streams}
    for llm in llms.values():
        common.warmup(llm, sampler)

    runs: dict[str, dict[int, list[dict[str, Any]]]] = {fmt: {n: [] for n in streams} for fmt in formats}
    order = list(formats)
    for _ in range(max(1, args.repeats)):
        for n in streams:
            for fmt in order:
                runs[fmt][n].append(timed_streams(llms[fmt], decode_prompts[n], args.output_len))
        order = order[1:] + order[:1]
    speed = {
        fmt: {
            str(n): {
                "decode_tok_s": median([r["decode_tok_s"] for r in rs]),
                "decode_tok_s_runs": [r["decode_tok_s"] for r in rs],
                "others_cpu_share_runs": [r["others_cpu_share"] for r in rs],
            }
            for n, rs in by_n.items()
        }
        for fmt, by_n in runs.items()
    }
    # the ratio to dense per round (each round's runs are seconds apart), then the median
    pairs = {
        fmt: {
            str(n): paired([a["decode_tok_s"] for a in runs[fmt][n]], [b["decode_tok_s"] for b in runs["dense"][n]])
            for n in streams
        }
        for fmt in formats
    }
    vs_dense = {fmt: {n: p.median for n, p in by_n.items()} for fmt, by_n in pairs.items()}

    prompts = QUALITY_PROMPTS[: args.num_prompts]
    scored = dict(llms)
    if args.reference_dtype:
        scored[args.reference_dtype] = factory(prefix_cache=args.prefix_cache, dtype=args.reference_dtype)
    answers = {}
    for name, llm in scored.items():
        llm.reset_prefix_cache()
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], common.greedy(args.answer_tokens), use_tqdm=False
        )
        answers[name] = [list(o.outputs[0].token_ids) for o in outs]
    with open(TEXT) as f:
        text_ids = llms["dense"].llm_engine.tokenizer.encode(f.read())
    quality: dict[str, dict[str, Any]] = {name: dict(perplexity(llm, text_ids)) for name, llm in scored.items()}
    for name in scored:
        quality[name]["vs_dense"] = agreement(answers["dense"], answers[name])
        if args.reference_dtype:
            quality[name]["vs_reference"] = agreement(answers[args.reference_dtype], answers[name])
    results: dict[str, Any] = {
        "config": common.run_config(
            args,
            llms["dense"],
            formats=formats,
            streams=streams,
            input_len=args.input_len,
            output_len=args.output_len,
            repeats=args.repeats,
            answer_tokens=args.answer_tokens,
            prompts=len(prompts),
        ),
        "kernels": {fmt: llm.llm_engine.kernels for fmt, llm in llms.items()},
        "speed": speed,
        "decode_tok_s_vs_dense": vs_dense,
        "paired_vs_dense": {fmt: {n: p.as_dict() for n, p in by_n.items()} for fmt, by_n in pairs.items()},
        "quality": quality,
        "reference_dtype": args.reference_dtype or None,
        "text": os.path.relpath(os.path.abspath(TEXT)),
    }
    results["cpu"] = results["config"]["cpu"]
    ref = args.reference_dtype

    def agree(name: str, key: str) -> str:
        a = quality[name].get(key)
        return "-" if a is None else f"{a['token_agreement']:.1%} ({a['identical_answers']}/{a['answers']})"

    rows = [
        (
            name,
            *(
                f"{speed[name][str(n)]['decode_tok_s']:.1f} ({vs_dense[name][str(n)]:.2f}x)" if name in speed else "-"
                for n in streams
            ),
            agree(name, "vs_dense"),
            agree(name, "vs_reference"),
            f"{quality[name]['perplexity']:.3f}",
        )
        for name in scored
    ]
    common.print_table(
        ["weights", *(f"{n} stream(s) tok/s" for n in streams), "agreement vs bf16", f"vs {ref or '-'}", "perplexity"],
        rows,
        title=f"weight formats, {args.dtype}, {args.num_threads or 'all'} threads, {results['cpu']['model']}",
    )
    print("decode tok/s against dense bf16, the median of the per-round ratios:")
    for fmt, by_count in pairs.items():
        for count, pair in by_count.items():
            if fmt != "dense":
                print(f"  {fmt}, {count} stream(s): {pair.describe()}")
    return results
