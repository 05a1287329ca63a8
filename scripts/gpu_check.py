"""The CUDA path, checked and timed on a GPU machine in one run (see docs/gpu.md).

The machine has no network and no room for the real weights, so the model is SmolLM2-135M's architecture
(config.json, tokenizer) with seeded random weights: exactness does not depend on the values, and speed depends
only on the shapes. The embedding is drawn wider than the usual init so greedy steps are rarely near-ties.

  python3 scripts/gpu_check.py --tokenizer-dir DIR --out DIR

Checks (fp32): prefixkv greedy == transformers greedy; caching on (hash, radix) == off; with a host-RAM KV tier
(when this prefixkv has one) == without, across an eviction. A divergence reports the top-2 logit gap at that
step. Timings (bf16): cold and warm TTFT of a 2048 + 50 prompt, 32 x (1024 shared + 50) and 32 x 512 unrelated
prompts with 32 output tokens each. Everything lands in OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
import traceback

import torch

DEVICE = "cuda"  # --device cpu: a dry run of this script (small sizes with --quick) before spending GPU time
QUICK = False
OUT_DIR = ""


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_model(tokenizer_dir: str, path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    config = LlamaConfig.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(path)


def prompts(tokenizer, n: int, shared: int, own: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 49152
    prefix = [rng.randrange(100, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(own)] for _ in range(n)]


def hf_greedy(path: str, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], object]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(DEVICE).eval()
    out = []
    with torch.no_grad():
        for ids in batch:
            gen = model.generate(
                torch.tensor([ids], device=DEVICE),
                max_new_tokens=max_tokens,
                do_sample=False,
                min_new_tokens=max_tokens,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out, model


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=DEVICE)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(name: str, got: list[list[int]], want: list[list[int]], prompts_: list[list[int]], hf_model) -> dict:
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            step = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            gap = top2_gap(hf_model, prompts_[i] + w[:step]) if hf_model is not None else None
            bad.append({"prompt": i, "step": step, "top2_gap": gap})
    return {"check": name, "prompts": len(got), "identical": len(got) - len(bad), "diverged": bad}


def generate(llm, batch: list[list[int]], max_tokens: int):
    from prefixkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def exactness(path: str, results: dict) -> None:
    from prefixkv.config import EngineConfig
    from prefixkv.llm import LLM
    from prefixkv.model.loader import load_model

    loaded = load_model(path, dtype="float32", device=DEVICE)
    tok = loaded.tokenizer
    batch = prompts(tok, 3 if QUICK else 12, 300, 40, seed=1)
    hf, hf_model = hf_greedy(path, batch, 16)
    checks = results.setdefault("fp32", [])
    outs = {}
    for cache in ("off", "hash", "radix"):
        llm = LLM(loaded_model=loaded, device=DEVICE, dtype="float32", prefix_cache=cache, kv_cache_tokens=16384)
        generate(llm, batch[:1], 16)  # the others then hit its prefix
        res = generate(llm, batch, 16)
        outs[cache] = [list(r.outputs[0].token_ids) for r in res]
        cached = sum(r.num_cached_tokens or 0 for r in res)
        checks.append({**compare(f"{cache} vs transformers", outs[cache], hf, batch, hf_model), "cached": cached})
        llm.close()
    for cache in ("hash", "radix"):
        checks.append(compare(f"{cache} vs off", outs[cache], outs["off"], batch, hf_model))
    tier_fields = {"kv_offload_host_size", "kv_offload_chunk_tokens"}
    if tier_fields <= {f for f in EngineConfig.__dataclass_fields__}:
        # a pool that holds one prompt: every prompt evicts the previous one, which comes back from host RAM
        long = prompts(tok, 2 if QUICK else 4, 600, 30, seed=2)
        want = [
            list(r.outputs[0].token_ids)
            for r in generate(
                LLM(loaded_model=loaded, device=DEVICE, dtype="float32", prefix_cache="off", kv_cache_tokens=1024),
                long,
                8,
            )
        ]
        llm = LLM(
            loaded_model=loaded,
            device=DEVICE,
            dtype="float32",
            kv_cache_tokens=1024,
            kv_offload_host_size=1 << 30,
            kv_offload_chunk_tokens=64,
        )
        first = [generate(llm, [p], 8)[0] for p in long]
        again = [generate(llm, [p], 8)[0] for p in long]
        got = [list(r.outputs[0].token_ids) for r in again]
        check = compare("host tier, reloaded after eviction, vs off", got, want, long, hf_model)
        check["cached_second_pass"] = [r.num_cached_tokens for r in again]
        check["first_pass_identical"] = [list(r.outputs[0].token_ids) for r in first] == want
        checks.append(check)
        llm.close()
    del hf_model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def timings(path: str, results: dict) -> None:
    from prefixkv.llm import LLM
    from prefixkv.model.loader import load_model

    loaded = load_model(path, dtype="bfloat16", device=DEVICE)
    tok = loaded.tokenizer
    llm = LLM(loaded_model=loaded, device=DEVICE, dtype="bfloat16", kv_cache_tokens=131072, max_num_seqs=64)
    t = results.setdefault("bf16", {})
    generate(llm, prompts(tok, 4, 64, 64, seed=99), 4)  # warm-up: allocator, cuBLAS handles
    scale = 8 if QUICK else 1
    system = prompts(tok, 2, 2048 // scale, 50, seed=3)

    def ttft(p: list[int]) -> float:
        _sync()
        t0 = time.perf_counter()
        generate(llm, [p], 1)
        _sync()
        return time.perf_counter() - t0

    t["ttft_cold_2048_50_s"] = ttft(system[0])
    t["ttft_warm_2048_50_s"] = ttft(system[1])
    fresh = prompts(tok, 1, 2048 // scale, 50, seed=5)[0]
    t["ttft_cold_again_2048_50_s"] = ttft(fresh)  # shapes seen once already: no first-call setup left
    if DEVICE == "cuda" and OUT_DIR:
        other = prompts(tok, 1, 2048 // scale, 50, seed=6)[0]
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            ttft(other)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with open(os.path.join(OUT_DIR, "cold_ttft_profile.txt"), "w") as f:
            f.write(table)
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    for name, batch in (
        ("shared_32x(1024+50)_out32", prompts(tok, 32 // scale, 1024 // scale, 50, seed=4)),
        ("unrelated_32x512_out32", [prompts(tok, 1, 0, 512 // scale, seed=10 + i)[0] for i in range(32 // scale)]),
    ):
        _sync()
        t0 = time.perf_counter()
        res = generate(llm, batch, 32)
        _sync()
        wall = time.perf_counter() - t0
        t[name] = {
            "output_tok_s": sum(len(r.outputs[0].token_ids) for r in res) / wall,
            "wall_s": wall,
            "cached_tokens": sum(r.num_cached_tokens or 0 for r in res),
        }
    llm.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a dry run)")
    args = p.parse_args()
    global DEVICE, QUICK, OUT_DIR
    DEVICE, QUICK, OUT_DIR = args.device, args.quick, args.out
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    results: dict = {"device": name, "torch": torch.__version__, "errors": []}
    model_dir = "/tmp/smollm2-arch-random"
    t0 = time.perf_counter()
    make_model(args.tokenizer_dir, model_dir)
    results["model_build_s"] = time.perf_counter() - t0
    for step in (exactness, timings):
        try:
            step(model_dir, results)
        except Exception:  # noqa: BLE001 - record and go on: one failing part must not lose the others' numbers
            results["errors"].append(f"{step.__name__}: {traceback.format_exc()}")
        print(json.dumps(results, indent=1), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
