"""Offline throughput: `prefixkv bench throughput` (unrelated prompts, optionally against Hugging Face) and
`prefixkv bench shared-prefix` (many requests behind one long prefix, caching on versus off).

Prompts are seeded random token ids, decoding is greedy with EOS ignored, so every engine and every repetition
does exactly the same number of prompt and output tokens and tok/s numbers are comparable.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.paired import paired
from prefixkv.bench.workloads import median, random_prompts, ratio, sampler_for, shared_prefix_prompts


def register(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="output and total tok/s on unrelated random prompts")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time Hugging Face transformers generate() on the same prompts, in this process",
    )
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=0,
        help="prompts per HF generate() call, left-padded (0: all prompts in one batch)",
    )
    p.add_argument(
        "--hf-gguf",
        default="dequantize",
        choices=["dequantize", "packed"],
        help="how transformers loads a .gguf: dequantize to dense --dtype weights (the same computation "
        "as prefixkv) or keep the packed blocks (transformers' own default, fp32 kernels)",
    )
    common.add_engine_args(p)
    p.set_defaults(func=run)

    s = subparsers.add_parser("shared-prefix", help="N requests sharing one long prefix: output tok/s, cache on vs off")
    s.add_argument("--prefix-len", type=int, default=1024)
    s.add_argument("--suffix-len", type=int, default=50, help="unique tokens after the shared prefix")
    s.add_argument("--output-len", type=int, default=32)
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternating order; medians reported")
    s.add_argument(
        "--warm-prefix",
        action="store_true",
        help="compute the prefix once (untimed) before each run, as on a server where it is hot; by "
        "default each run starts from an empty cache and the first requests compute it",
    )
    common.add_engine_args(s)
    s.set_defaults(func=run_shared_prefix)


# -- throughput ----------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None, hf_loader=None) -> dict:
    """Time prefixkv (and optionally HF) on num_prompts unrelated prompts; all submitted at once. hf_loader(args)
    -> (transformers model, path) replaces load_hf_model (a test hands in the model it already loaded)."""
    llm = common.factory_for(args, llm_factory)(prefix_cache=args.prefix_cache)
    sampler = sampler_for(llm, seed=args.seed)
    prompts = random_prompts(sampler, args.num_prompts, args.input_len)
    common.warmup(llm, sampler)
    runs = [common.timed_generate(llm, prompts, args.output_len) for _ in range(max(1, args.repeats))]
    ours: dict[str, Any] = {k: median([r[k] for r in runs]) for k in ("elapsed_s", "output_tok_s", "total_tok_s")}
    ours.update(
        prompt_tokens=runs[0]["prompt_tokens"],
        output_tokens=runs[0]["output_tokens"],
        cached_tokens=runs[0]["cached_tokens"],
        runs=[common.drop_token_ids(r) for r in runs],
    )
    results: dict[str, Any] = {
        "config": common.run_config(
            args,
            llm,
            prefix_cache=args.prefix_cache,
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts=args.num_prompts,
            repeats=args.repeats,
        ),
        "prefixkv": ours,
        "reference": {
            "label": common.REFERENCE_LABEL,
            "unrelated_512_output_tok_s": common.REFERENCE["unrelated_512_output_tok_s"],
        },
    }
    rows = [("prefixkv", args.prefix_cache, ours["elapsed_s"], ours["output_tok_s"], ours["total_tok_s"])]
    if args.compare_hf:
        hf = run_hf(args, llm, prompts, hf_loader or load_hf_model)
        hf["token_match"] = _match_fraction(runs[0]["output_token_ids"], hf.pop("output_token_ids"))
        results["hf"] = hf
        results["ratio_output_tok_s_prefixkv_over_hf"] = ratio(ours["output_tok_s"], hf["output_tok_s"])
        rows.append((f"HF generate ({hf['batching']})", "-", hf["elapsed_s"], hf["output_tok_s"], hf["total_tok_s"]))
    cfg = results["config"]
    common.print_table(
        ["engine", "cache", "elapsed s", "output tok/s", "total tok/s"],
        rows,
        title=f"throughput: {args.num_prompts} prompts x {args.input_len} in + {args.output_len} out, "
        f"{cfg['dtype']}, {cfg['num_threads']} threads",
    )
    if args.compare_hf:
        print(
            f"prefixkv / HF output tok/s: {results['ratio_output_tok_s_prefixkv_over_hf']:.2f}x "
            f"(greedy outputs identical for {results['hf']['token_match']:.0%} of prompts)"
        )
    print(
        f"{common.REFERENCE_LABEL}: 32 unrelated 512-token prompts, 32 out: "
        f"{common.REFERENCE['unrelated_512_output_tok_s']:.0f} output tok/s"
    )
    return results


def run_hf(args: argparse.Namespace, llm, prompts: list[list[int]], hf_loader) -> dict:
    """Plain transformers generate() on the same checkpoint and prompts: greedy, exactly output_len new tokens."""
    import torch

    model, model_path = hf_loader(args)
    pad_id = _pad_id(llm)
    batch_size = args.hf_batch_size or len(prompts)
    with torch.inference_mode():
        _hf_generate(model, prompts[:1], 2, pad_id)  # warm-up, like ours
        start = time.perf_counter()
        out_ids = []
        for i in range(0, len(prompts), batch_size):
            out_ids += _hf_generate(model, prompts[i : i + batch_size], args.output_len, pad_id)
        elapsed = time.perf_counter() - start
    out_tokens = sum(len(o) for o in out_ids)
    in_tokens = sum(len(p) for p in prompts)
    del model
    return {
        "model_path": model_path,
        "gguf_weights": getattr(args, "hf_gguf", None),
        "dtype": args.dtype,
        "batching": f"batches of {batch_size}, left padding",
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tok_s": ratio(out_tokens, elapsed),
        "total_tok_s": ratio(in_tokens + out_tokens, elapsed),
        "output_token_ids": out_ids,
    }


def load_hf_model(args: argparse.Namespace):
    """AutoModelForCausalLM for --model. For a .gguf, recent transformers keeps quantised blocks packed by default;
    --hf-gguf dequantize (the default here) unpacks them to dense weights, as prefixkv's loader does."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixkv.model.loader import default_model_path

    path = args.model or default_model_path()
    dtype = getattr(torch, args.dtype)
    if path.endswith(".gguf"):
        kwargs = {}
        if getattr(args, "hf_gguf", "dequantize") == "dequantize":
            try:
                from transformers import GgufConfig
            except ImportError:  # older transformers: GGUF weights are always dequantised at load
                pass
            else:
                kwargs["quantization_config"] = GgufConfig(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), dtype=dtype, **kwargs
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), path


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
    )
    return [row[width:].tolist() for row in out]


def _pad_id(llm) -> int:
    hf = llm.get_tokenizer().hf
    for candidate in (hf.pad_token_id, hf.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def _match_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    return ratio(sum(x == y for x, y in zip(a, b)), len(a))


# -- shared prefix -------------------------------------------------------------------------------------------
def run_shared_prefix(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    """All requests submitted at once behind one prefix; off/on runs alternate, and the on/off ratio is the median of
    the per-round ratios (each round's two runs back to back), every round's listed.

    From an empty cache (the default), requests admitted in the first step all compute the prefix themselves;
    later ones hit it, so the hit count depends on max_num_batched_tokens. --warm-prefix measures the steady state.
    """
    on_mode, llms = common.on_and_off_engines(args, llm_factory)
    sampler = sampler_for(llms["off"], seed=args.seed)
    prompts = shared_prefix_prompts(sampler, args.num_prompts, args.prefix_len, args.suffix_len)
    prime = [prompts[0][: args.prefix_len] + sampler.tokens(args.suffix_len)] if args.warm_prefix else []
    for llm in llms.values():
        common.warmup(llm, sampler)
    runs: dict[str, list[dict]] = {mode: [] for mode in llms}
    for rep in range(max(1, args.repeats)):
        order = ["off", on_mode] if rep % 2 == 0 else [on_mode, "off"]
        for mode in order:
            runs[mode].append(common.timed_generate(llms[mode], prompts, args.output_len, prime=prime))
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {
            "output_tok_s": median([r["output_tok_s"] for r in rs]),
            "total_tok_s": median([r["total_tok_s"] for r in rs]),
            "elapsed_s": median([r["elapsed_s"] for r in rs]),
            "cached_tokens": rs[0]["cached_tokens"],
            "prompt_tokens": rs[0]["prompt_tokens"],
            "output_tokens": rs[0]["output_tokens"],
            "runs": [common.drop_token_ids(r) for r in rs],
        }
    pair = paired([r["output_tok_s"] for r in runs[on_mode]], [r["output_tok_s"] for r in runs["off"]])
    speedup = pair.median
    same = runs["off"][0]["output_token_ids"] == runs[on_mode][0]["output_token_ids"]
    results = {
        "config": common.run_config(
            args,
            llms["off"],
            prefix_cache_on=on_mode,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            output_len=args.output_len,
            num_prompts=args.num_prompts,
            repeats=args.repeats,
            prefix_state="warm" if args.warm_prefix else "cold",
        ),
        "modes": summary,
        "ratio_output_tok_s_on_over_off": speedup,
        "paired_output_tok_s_on_over_off": pair.as_dict(),
        "outputs_identical_on_off": same,
        "reference": {
            "label": common.REFERENCE_LABEL,
            "output_tok_s_on": common.REFERENCE["shared_prefix_output_tok_s_on"],
            "output_tok_s_off": common.REFERENCE["shared_prefix_output_tok_s_off"],
        },
    }
    cfg = results["config"]
    rows = [
        (mode, s["elapsed_s"], s["output_tok_s"], s["total_tok_s"], f"{s['cached_tokens']}/{s['prompt_tokens']}")
        for mode, s in summary.items()
    ]
    rows.append((common.REFERENCE_LABEL + " on", "-", common.REFERENCE["shared_prefix_output_tok_s_on"], "-", "-"))
    rows.append((common.REFERENCE_LABEL + " off", "-", common.REFERENCE["shared_prefix_output_tok_s_off"], "-", "-"))
    common.print_table(
        ["cache", "elapsed s", "output tok/s", "total tok/s", "cached/prompt tokens"],
        rows,
        title=f"shared prefix: {args.num_prompts} requests x ({args.prefix_len} shared + "
        f"{args.suffix_len} unique) in, {args.output_len} out, {cfg['prefix_state']} prefix, "
        f"{cfg['dtype']}, {cfg['num_threads']} threads",
    )
    ref = common.REFERENCE
    print(
        f"caching on/off output tok/s: {pair.describe()} (reference vLLM CPU: "
        f"{ref['shared_prefix_output_tok_s_on'] / ref['shared_prefix_output_tok_s_off']:.2f}x)"
        f"; greedy outputs identical on/off: {same}"
    )
    return results


def plot(results: dict, png_path: str) -> None:
    """Bars of output tok/s: prefixkv vs HF (throughput) or caching off vs on (shared-prefix), with references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "modes" in results:  # shared-prefix
        labels = [f"prefixkv {m}" for m in results["modes"]] + ["vLLM CPU off (ref)", "vLLM CPU on (ref)"]
        values = [s["output_tok_s"] for s in results["modes"].values()]
        values += [results["reference"]["output_tok_s_off"], results["reference"]["output_tok_s_on"]]
        title = "shared prefix: output tok/s"
    else:
        labels = ["prefixkv"] + (["HF generate"] if "hf" in results else []) + ["vLLM CPU (ref)"]
        values = [results["prefixkv"]["output_tok_s"]] + ([results["hf"]["output_tok_s"]] if "hf" in results else [])
        values.append(results["reference"]["unrelated_512_output_tok_s"])
        title = "throughput: output tok/s"
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = ["tab:gray" if label.endswith("(ref)") else "tab:blue" for label in labels]
    ax.bar(labels, values, color=colors)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{title} ({cfg['dtype']}, {cfg['num_threads']} threads)")
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
