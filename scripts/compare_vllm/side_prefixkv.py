"""The prefixkv side, run with prefixkv's venv: `python -m compare_vllm.side_prefixkv versions|offline ...`.

  versions                          print the versions this venv runs, as JSON
  offline --sizes J --threads N --out F [--model DIR]   the offline rows on one prefixkv.llm.LLM, results as JSON
                                                        in F

The engine runs as a user would build it (the default model unless --model names the checkpoint vLLM loads too,
prefixkv's default prefix cache and page size), at bf16 on N threads with the same scheduler limits as the vLLM
side.
"""

from __future__ import annotations

import argparse
import json
import sys


def versions() -> dict:
    """Versions, and the defaults the served engine resolves (the server runs prefixkv's own defaults)."""
    import torch

    import prefixkv
    from prefixkv.config import EngineConfig

    defaults = EngineConfig.from_kwargs()
    return {
        "prefixkv": prefixkv.__version__,
        "torch": torch.__version__,
        "python": sys.version,
        "default_prefix_cache": defaults.prefix_cache,
        "default_page_size": defaults.tokens_per_page,
    }


def engine_config(llm) -> dict:
    """The options the engine resolved (page size and pool size are derived at construction)."""
    cfg, engine = llm.config, llm.llm_engine
    info = {
        "model": cfg.model,  # None: the default model
        "prefix_cache": cfg.prefix_cache,
        "page_size": cfg.tokens_per_page,
        "kv_cache_tokens": engine.kv.num_pages * engine.kv.page_size,
        "dtype": cfg.dtype,
        "num_threads": cfg.num_threads,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "schedule_policy": cfg.schedule_policy,
    }
    try:
        from prefixkv.model import native

        info["native_kernels"] = native.module() is not None
    except Exception as exc:  # noqa: BLE001 - only a label in the report; never worth failing the run for
        info["native_kernels"] = f"unknown ({type(exc).__name__})"
    return info


def generate_fn(llm):
    """The rows' view of an LLM: greedy, ignore_eos, token-id prompts in; (output, cached) token counts out."""
    from prefixkv.sampling_params import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(len(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]

    return generate


def offline(sizes_json: str, threads: int, out_path: str, seed: int, model: str | None = None) -> None:
    from compare_vllm.offline_rows import run_offline_rows
    from compare_vllm.workloads import sizes_from_dict
    from prefixkv.llm import LLM

    sizes = sizes_from_dict(json.loads(sizes_json))
    llm = LLM(
        model=model,
        dtype="bfloat16",
        num_threads=threads,
        max_model_len=sizes.max_model_len,
        max_num_seqs=sizes.max_num_seqs,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        kv_cache_memory=sizes.kv_cache_bytes,
        seed=seed,
    )

    rows = run_offline_rows(generate_fn(llm), sizes, seed)
    result = {"engine": engine_config(llm), "versions": versions(), "rows": rows}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m compare_vllm.side_prefixkv")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions")
    o = sub.add_parser("offline")
    o.add_argument("--sizes", required=True, help="the Sizes as JSON")
    o.add_argument("--threads", type=int, required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--model", default=None, help="a checkpoint directory (default: prefixkv's default model)")
    args = p.parse_args()
    if args.cmd == "versions":
        print(json.dumps(versions()))
    else:
        offline(args.sizes, args.threads, args.out, args.seed, args.model)


if __name__ == "__main__":
    main()
