"""What every benchmark needs: engine options, building LLMs, timing a batch, tables and reference numbers.

Each benchmark's run(args, llm_factory=None) builds its engines through one factory, so a test (or a script
running several benchmarks) can hand in a factory that reuses already loaded models instead of loading new ones.
Benchmarks always reset the prefix cache before a measurement, so a reused engine measures the same as a new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import platform
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prefixkv import engine_args
from prefixkv.config import EngineConfig
from prefixkv.stats import ratio, summarize

if TYPE_CHECKING:
    from prefixkv.llm import LLM

# Measured by the project with vLLM on CPU, same model, bf16, 2 threads, on this machine type. Printed beside our
# numbers for orientation only: they were not measured by this run.
REFERENCE = {
    "system_prompt_cold_ttft_s": 0.98,
    "system_prompt_warm_ttft_s": 0.055,
    "shared_prefix_output_tok_s_on": 426.0,
    "shared_prefix_output_tok_s_off": 65.0,
    "unrelated_512_output_tok_s": 150.0,
}
REFERENCE_LABEL = "reference (vLLM CPU, not measured here)"

LLMFactory = Callable[..., "LLM"]  # (prefix_cache=..., **engine overrides) -> LLM


def add_engine_args(
    p: argparse.ArgumentParser,
    exclude: Collection[str] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """The same engine options as `prefixkv generate`; --seed also seeds the synthetic prompts. `exclude` leaves
    out the fields a benchmark sets itself, `aliases` adds its own names for a field (engine_args.add_engine_args),
    `defaults` replaces the engine's defaults with the benchmark's (field name -> value), in --help too."""
    engine_args.add_engine_args(p, exclude, aliases)
    if not defaults:
        return
    p.set_defaults(**defaults)
    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for action in p._actions:  # argparse has no public list of its actions
        if action.dest not in defaults or action.dest not in engine_defaults or not action.help:
            continue
        engine_default = engine_defaults[action.dest]
        shown = "" if engine_default is None else f" (default: {engine_default})"
        if action.help.endswith(shown) and f"--{action.dest.replace('_', '-')}" in action.option_strings:
            action.help = f"{action.help[: len(action.help) - len(shown)]} (default: {defaults[action.dest]})"


def make_llm(args: argparse.Namespace, prefix_cache: str | None = None, **overrides) -> LLM:
    """An LLM from the command-line options, with prefix_cache and any other option overridden."""
    from prefixkv.llm import LLM

    kwargs = engine_args.engine_kwargs(args)
    if prefix_cache is not None:
        kwargs["prefix_cache"] = prefix_cache  # page_size stays None unless given: each kind takes its default
    kwargs.update(overrides)
    return LLM(**kwargs)


def factory_for(args: argparse.Namespace, llm_factory: LLMFactory | None) -> LLMFactory:
    """The factory a benchmark builds engines with: the given one, or make_llm over the parsed options."""
    if llm_factory is not None:
        return llm_factory
    return functools.partial(_make_llm_late, args)


def _make_llm_late(args: argparse.Namespace, *a, **kw) -> LLM:
    return make_llm(args, *a, **kw)  # looked up at call time so tests can monkeypatch common.make_llm


def cache_mode_on(args: argparse.Namespace) -> str:
    """The cache kind for the 'caching on' side of an on/off comparison: --prefix-cache, or hash if that is off."""
    return args.prefix_cache if args.prefix_cache != "off" else "hash"


def on_and_off_engines(args: argparse.Namespace, llm_factory: LLMFactory | None) -> tuple[str, dict]:
    """The caching-on engine (the --prefix-cache kind, hash when that says off) and its caching-off twin."""
    factory = factory_for(args, llm_factory)
    on_mode = cache_mode_on(args)
    return on_mode, {on_mode: factory(prefix_cache=on_mode), "off": factory(prefix_cache="off")}


def warmup(llm, sampler, prompt_len: int = 32) -> None:
    """One short request, so the first measured one does not pay for lazy torch initialisation; then forget it."""
    from prefixkv.sampling_params import SamplingParams

    llm.generate(
        [sampler.tokens(prompt_len)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    llm.reset_prefix_cache()


def greedy(max_tokens: int):
    """Greedy decoding that runs to exactly max_tokens (EOS ignored), so every run does the same work."""
    from prefixkv.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed_generate(llm, prompts: Sequence[list[int]], max_tokens: int, prime: Sequence[list[int]] = ()) -> dict:
    """Run one batch to completion after emptying the prefix cache (then running the untimed `prime` prompts,
    to start from a known cache state); wall time (and the part of it spent outside the model runner: scheduling,
    cache bookkeeping, detokenisation) and token counts."""
    llm.reset_prefix_cache()
    if prime:
        llm.generate([list(p) for p in prime], greedy(1), use_tqdm=False)
    model_before = llm.llm_engine.get_stats().model_seconds_total
    start = time.perf_counter()
    outs = llm.generate([list(p) for p in prompts], greedy(max_tokens), use_tqdm=False)
    elapsed = time.perf_counter() - start
    model_s = llm.llm_engine.get_stats().model_seconds_total - model_before
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    ttfts = [o.metrics.ttft for o in outs if o.metrics is not None and o.metrics.ttft is not None]
    return {
        "elapsed_s": elapsed,
        "model_s": model_s,
        "outside_model_s": elapsed - model_s,
        "num_requests": len(outs),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": cached,
        "output_tok_s": ratio(out_tokens, elapsed),
        "total_tok_s": ratio(in_tokens + out_tokens, elapsed),
        "ttft_s": summarize(ttfts),
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def run_config(args: argparse.Namespace, llm, **sizes) -> dict:
    """The settings a reader needs to reproduce or compare a result."""
    import torch

    from prefixkv.model import cpu_features

    engine = llm.llm_engine
    return {
        "cpu": cpu_features.describe(),
        "kernels": dict(engine.kernels),
        "model": engine.model_name,
        "model_arg": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "num_threads": torch.get_num_threads(),
        "num_threads_arg": args.num_threads,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_tokens": engine.kv.num_pages * engine.kv.page_size,
        "hash_algo": args.prefix_caching_hash_algo,
        "schedule_policy": args.schedule_policy,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        **sizes,
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> None:
    """A plain fixed-width table: readable in a terminal and in a pasted log."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def drop_token_ids(run: dict) -> dict:
    """A run's numbers without the generated ids (they bloat the JSON; keep only what was compared)."""
    return {k: v for k, v in run.items() if k != "output_token_ids"}
