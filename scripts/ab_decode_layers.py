"""A/B of two builds of the native decode loop (DecodeLayers) in one process: the same packed weights and the same
captured inputs of one decode step (--streams streams, the 101st token of their greedy answers), calls
alternating, the ratio per pair. Both builds' outputs must be the same bits.

    python scripts/ab_decode_layers.py --old ~/.cache/prefixkv/native/<hash>/prefixkv_native_<hash>.so \
        --out docs/benchmarks/decode/amd_epyc/lean_loop_ab/ab.json

--old: a build of another checkout (its native directory); the new side is this checkout's build. Two builds load
side by side because DecodeLayers is bound module-local.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

from prefixkv import LLM, SamplingParams
from prefixkv.model import cpu_features, native


def load(path: str):
    name = path.rsplit("/", 1)[-1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def captured_step(llm, streams: int, token: int = 100) -> list:
    """The arguments of the fused decode call that computes the given output token of `streams` greedy streams
    (50-token prompts of token ids, started together)."""
    model = llm.llm_engine.runner.model
    fused, calls = model.fused_decode, []

    class Capture:
        def run(self, *args):
            small = [a.clone() if isinstance(a, torch.Tensor) and a.numel() < 10**6 else a for a in args]
            calls.append(small)  # the pool (the large tensor) is passed as is
            return fused.run(*args)

    model.fused_decode = Capture()
    try:
        params = SamplingParams(temperature=0, max_tokens=token + 2, ignore_eos=True)
        prompts = [[1000 + 37 * s + i for i in range(50)] for s in range(streams)]
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.fused_decode = fused
    return calls[token - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the other build's .so")
    p.add_argument("--streams", type=int, default=1, help="decodes in the captured step")
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(2)
    new = native.module()
    if new is None:
        raise SystemExit("this checkout's native kernels are not built")
    old = load(args.old)
    llm = LLM(dtype="bfloat16", kv_cache_tokens=16384)
    model = llm.llm_engine.runner.model
    step = captured_step(llm, args.streams)
    weights = model.decode_layers_arguments(llm.llm_engine.runner.options)  # as the engine built its own
    sides = {"old": old.DecodeLayers(**weights), "new": new.DecodeLayers(**weights)}
    with torch.inference_mode():
        outs = {k: v.run(step[0].clone(), *step[1:]) for k, v in sides.items()}
        if not torch.equal(outs["old"], outs["new"]):
            raise SystemExit("the two builds compute different bits")

        def timed(side: str) -> float:
            h = step[0].clone()
            start = time.perf_counter()
            sides[side].run(h, *step[1:])
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.pairs):
            for side in ("old", "new") if i % 2 else ("new", "old"):
                times[side].append(timed(side))
    ratios = [a / b for a, b in zip(times["old"], times["new"])]
    result = {
        "cpu": cpu_features.describe(),
        "streams": args.streams,
        "context_len": int(step[6][0]),
        "pairs": args.pairs,
        "old_ms_median": statistics.median(times["old"]) * 1e3,
        "new_ms_median": statistics.median(times["new"]) * 1e3,
        "old_minus_new_ms_median": statistics.median([(a - b) * 1e3 for a, b in zip(times["old"], times["new"])]),
        "old_over_new_median": statistics.median(ratios),
        "old_over_new_quartiles": statistics.quantiles(ratios, n=4),
        "identical_output": True,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
