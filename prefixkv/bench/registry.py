"""`prefixkv bench NAME`: each benchmark module registers its own subcommand; results go to JSON (and a plot)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import time

from prefixkv.model import cpu_features

BENCH_MODULES = [
    "throughput",
    "system_prompt",
    "multi_turn",
    "zero_hit",
    "thrash",
    "flood",
    "page_size",
    "schedule_cost",
    "serve_client",
    "routing",
    "kv_offload",
    "kv_remote",
    "cache_invariance",
    "decode",
    "weight_formats",
    "structured",
    "agent_tools",
]


def register_bench(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks; results written as JSON and plots")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(f"prefixkv.bench.{name}")
        except ImportError:
            continue
        before = set(bench_sub.choices)
        module.register(bench_sub)
        for added in set(bench_sub.choices) - before:
            p = bench_sub.choices[added]
            p.add_argument("--output-dir", default="bench_results", help="where JSON results and plots go")
            func = p.get_default("func")
            p.set_defaults(func=_writing_results(added, module, func))


def source_commit() -> dict:
    """The commit the package runs from (scripts/headline.py names it beside the figure), and whether its code
    had changes not committed; nulls outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no", "--", os.path.dirname(here))
    return {"prefixkv_commit": commit, "prefixkv_uncommitted_changes": None if commit is None else bool(changes)}


def _model_shape(args: argparse.Namespace) -> dict:
    """shapes.model_record of the bench's --model; a model it cannot read is recorded, never fatal (the numbers
    are kept)."""
    from prefixkv.model.shapes import model_record

    model = getattr(args, "model", None)
    if model is not None and not os.path.exists(os.path.expanduser(model)):  # e.g. serve_client's served name
        return {"model": model, "shape": "not read: not a local model path"}
    try:
        return model_record(model)
    except (OSError, ValueError, KeyError) as e:
        return {"model": model, "error": str(e)}


def _writing_results(name: str, module, func):
    def run(args: argparse.Namespace) -> int:
        results = func(args)
        if results is None:
            return 0
        results.setdefault("benchmark", name)
        results.setdefault("timestamp", time.strftime("%Y-%m-%dT%H:%M:%S"))
        results.setdefault("cpu", cpu_features.describe())  # a number means little without the machine
        results.setdefault("model_shape", _model_shape(args))  # nor without the model's shape
        if not results.get("prefixkv_commit"):  # a script that ran another checkout names its own
            results.update(source_commit())
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {path}")
        plot = getattr(module, "plot", None)
        if plot is not None:
            try:
                png = os.path.join(args.output_dir, f"{name}.png")
                plot(results, png)
                print(f"plot written to {png}")
            except Exception as e:  # a missing plotting backend must not lose the numbers
                print(f"plot skipped: {e}")
        return 0

    return run
