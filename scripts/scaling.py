"""How prefixkv's speed grows with the model (issue 42): prefill against the best GEMM rate, decode against the
weight-read floor, one row per model, and a prediction of the largest model from the smaller rows.

    .venv/bin/python scripts/scaling.py --models DIR,DIR,... --predict DIR [--out docs/benchmarks/scaling/...]

Each model (a Hugging Face checkpoint, e.g. from `prefixkv checkpoint --shape ...`) is measured in child
processes of its own, one after another, bf16, on --threads threads:

- prefill: one cold prompt of --prompt-tokens random ids (after an untimed shorter one), best of --repeats; its
  FLOPs are the matmuls' (2 x layer matmul parameters x tokens, plus one lm_head row) and the attention's (QK^T
  and PV under a causal mask: 2 x layers x heads x head_dim x tokens^2); FLOP/s over the best GEMM rate measured
  on the same model's four layer shapes at as many rows (the faster of torch.matmul bf16 and prefixkv's own
  paths, compare_vllm.limits.measure_gemm) gives the efficiency (the issue's target: 70%);
- decode: `prefixkv bench decode` at 1, 4 and 16 streams (--output-len tokens, --repeats rounds, medians), its
  step time over its own floor (the bf16 weight bytes a step reads over the measured read bandwidth; target
  1.3x at one stream).

The prediction is made before the --predict model is measured, from the smaller rows only: prefill time = its
FLOPs / (the smaller rows' median efficiency x the GEMM rate measured on its shapes), decode step = its floor x
the smaller rows' median step-over-floor at each stream count. Then it is measured, and the error is
measured / predicted - 1. A GEMM microbenchmark and a bandwidth pass on the target are not the target running,
so they may be used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAMS = (1, 4, 16)


def model_size(model_dir: str):
    """compare_vllm.limits.ModelSize of the checkpoint (its config.json), and its shape record's name."""
    from compare_vllm.limits import ModelSize

    from prefixkv.model.shapes import model_record

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    record = model_record(model_dir)
    return ModelSize.from_hf_config(cfg), record.get("shape", record["model"])


def prefill_flops(size, tokens: int) -> float:
    """The matmuls' FLOPs (one lm_head row) and the causal attention's (QK^T and PV, half the square each)."""
    matmuls = 2.0 * size.layer_params * tokens + 2.0 * size.head_params
    return matmuls + 2.0 * size.layers * size.heads * size.head_dim * tokens * tokens


def _child(args: list[str], threads: int) -> dict:
    """Run this script (or prefixkv) in a child process, its JSON on the last stdout line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{REPO}:{REPO}/scripts"}
    out = subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure_prefill(model: str, tokens: int, repeats: int, threads: int) -> dict:
    """Child: the best cold prefill time of one prompt, and the GEMM rate on the model's shapes."""
    import torch
    from compare_vllm.limits import measure_gemm

    from prefixkv.bench import workloads
    from prefixkv.llm import LLM
    from prefixkv.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    size, _ = model_size(model)
    gemm = measure_gemm(3, rows=(tokens,), shapes=size.layer_shapes)
    best_gemm = max(gemm["gemm_flops_s"], gemm["prefixkv_gemm_flops_s"])
    llm = LLM(model=model, dtype="bfloat16", max_model_len=tokens + 16, max_num_batched_tokens=tokens)
    sampler = workloads.sampler_for(llm)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(workloads.random_prompts(sampler, 1, 256), one, use_tqdm=False)  # untimed: allocations
    times = []
    for prompt in workloads.random_prompts(sampler, repeats, tokens):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    flops = prefill_flops(size, tokens)
    return {
        "prompt_tokens": tokens,
        "prefill_s_runs": times,
        "prefill_s": min(times),
        "flops": flops,
        "flops_s": flops / min(times),
        "gemm_flops_s": best_gemm,
        "gemm": gemm,
        "efficiency": flops / min(times) / best_gemm,
        "kernels": dict(llm.llm_engine.kernels),
    }


def measure_decode(model: str, output_len: int, repeats: int, threads: int, out_dir: str) -> dict:
    """Child: `prefixkv bench decode` on the model; the step times and floors of its JSON."""
    os.makedirs(out_dir, exist_ok=True)
    argv = ["-m", "prefixkv", "bench", "decode", "--model", model, "--dtype", "bfloat16", "--num-threads",
            str(threads), "--streams", ",".join(map(str, STREAMS)), "--output-len", str(output_len), "--repeats",
            str(repeats), "--no-split", "--output-dir", out_dir]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, *argv], env=env, check=True, capture_output=True, text=True, cwd=REPO)
    with open(os.path.join(out_dir, "decode.json")) as f:
        res = json.load(f)
    floor_ms = res["floor"]["floor_ms_per_step"]
    return {
        "floor_ms_per_step": floor_ms,
        "floor_bytes": res["floor"]["floor_bytes"],
        "bandwidth_bytes_s": res["floor"]["bandwidth_bytes_s"],
        "step_ms": {n: res["speed"][n]["decode_step_ms"] for n in map(str, STREAMS)},
        "step_ms_runs": {n: res["speed"][n]["decode_step_ms_runs"] for n in map(str, STREAMS)},
        "over_floor": {n: res["measured_over_floor"][n] for n in map(str, STREAMS)},
        "over_round_floor": {n: res["measured_over_round_floor"][n] for n in map(str, STREAMS)},
    }


def measure_model(model: str, a: argparse.Namespace) -> dict:
    size, shape = model_size(model)
    common = ["--model", model, "--threads", str(a.threads), "--repeats", str(a.repeats)]
    prefill = _child([__file__, "_prefill", "--prompt-tokens", str(a.prompt_tokens), *common], a.threads)
    decode_dir = os.path.join(a.out, "decode", shape)
    decode = _child([__file__, "_decode", "--output-len", str(a.output_len), "--out", decode_dir, *common], a.threads)
    return {"model": model, "shape": shape, "layer_params": size.layer_params, "head_params": size.head_params,
            "prefill": prefill, "decode": decode}  # fmt: skip


def predict(smaller: list[dict], target: str, a: argparse.Namespace) -> dict:
    """The target's prefill and decode times from the smaller rows' efficiencies and the target's own GEMM rate
    and floor (the floor's bandwidth is the smaller rows' median: the target has not run)."""
    import torch
    from compare_vllm.limits import measure_gemm

    torch.set_num_threads(a.threads)
    size, _ = model_size(target)
    gemm = measure_gemm(3, rows=(a.prompt_tokens,), shapes=size.layer_shapes)
    rate = max(gemm["gemm_flops_s"], gemm["prefixkv_gemm_flops_s"])
    efficiency = statistics.median(r["prefill"]["efficiency"] for r in smaller)
    bandwidth = statistics.median(r["decode"]["bandwidth_bytes_s"] for r in smaller)
    floor_bytes = size.weight_bytes  # bf16 matmul weights and the lm_head (bench decode adds the norms' few)
    floor_ms = floor_bytes / bandwidth * 1e3
    over = {n: statistics.median(r["decode"]["over_floor"][n] for r in smaller) for n in map(str, STREAMS)}
    return {
        "prefill_s": prefill_flops(size, a.prompt_tokens) / (efficiency * rate),
        "from_efficiency": efficiency,
        "gemm_flops_s": rate,
        "floor_ms_per_step": floor_ms,
        "from_over_floor": over,
        "step_ms": {n: floor_ms * over[n] for n in over},
    }


def table(rows: list[dict]) -> str:
    tokens = rows[0]["prefill"]["prompt_tokens"] if rows else 0
    head = f"| model | params (layers + head) | prefill {tokens}: s, GFLOP/s, of GEMM | GEMM GFLOP/s |"
    head += " decode ms/step 1 / 4 / 16 | x floor 1 / 4 / 16 | floor ms |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        p, d = r["prefill"], r["decode"]
        params = f"{(r['layer_params'] + r['head_params']) / 1e9:.2f} B"
        steps = " / ".join(f"{d['step_ms'][n]:.1f}" for n in map(str, STREAMS))
        over = " / ".join(f"{d['over_floor'][n]:.2f}" for n in map(str, STREAMS))
        lines.append(
            f"| {r['shape']} | {params} | {p['prefill_s']:.2f}, {p['flops_s'] / 1e9:.0f}, {p['efficiency']:.0%} | "
            f"{p['gemm_flops_s'] / 1e9:.0f} | {steps} | {over} | {d['floor_ms_per_step']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=("run", "_prefill", "_decode"), help=argparse.SUPPRESS)
    p.add_argument("--models", default="", help="comma-separated checkpoint dirs, smallest first")
    p.add_argument("--predict", default=None, help="a larger checkpoint, predicted from --models, then measured")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=os.path.join(REPO, "bench_results", "scaling"))
    a = p.parse_args()
    if a.mode == "_prefill":
        print(json.dumps(measure_prefill(a.model, a.prompt_tokens, a.repeats, a.threads)))
        return
    if a.mode == "_decode":
        print(json.dumps(measure_decode(a.model, a.output_len, a.repeats, a.threads, a.out)))
        return
    from prefixkv.bench.registry import source_commit
    from prefixkv.model import cpu_features

    os.makedirs(a.out, exist_ok=True)
    rows = [measure_model(m, a) for m in a.models.split(",") if m]
    result: dict = {"cpu": cpu_features.describe(), **source_commit(), "threads": a.threads, "rows": rows}
    if a.predict:
        result["prediction"] = predict(rows, a.predict, a)
        measured = measure_model(a.predict, a)
        rows.append(measured)
        pred = result["prediction"]
        result["prediction_error"] = {
            "prefill": measured["prefill"]["prefill_s"] / pred["prefill_s"] - 1,
            "decode_step": {n: measured["decode"]["step_ms"][n] / pred["step_ms"][n] - 1 for n in pred["step_ms"]},
        }
    with open(os.path.join(a.out, "scaling.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = table(rows)
    if a.predict:
        err, pred = result["prediction_error"], result["prediction"]
        text += (
            f"\n\nprediction for {rows[-1]['shape']} from the rows above it: prefill "
            f"{result['prediction']['prefill_s']:.2f} s (error {err['prefill']:+.0%}), decode ms/step "
            + ", ".join(
                f"{n}: {result['prediction']['step_ms'][n]:.1f} ({e:+.0%})" for n, e in err["decode_step"].items()
            )
        )
    with open(os.path.join(a.out, "scaling.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
