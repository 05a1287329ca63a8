"""The brief's three reference workloads on vLLM's CPU build, to run beside `prefixkv bench` on one machine.

Two steps, two virtual environments (vLLM pins its own torch):
  .venv/bin/python scripts/vllm_reference.py export /tmp/smollm2-hf     # the default GGUF as an HF checkpoint
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 /path/to/vllm-venv/bin/python scripts/vllm_reference.py run /tmp/smollm2-hf on
  (and again with `off` for prefix caching off: one engine per process)
The export writes the dequantised weights prefixkv serves, so both engines run the same model. Prompts are
random token ids of the same lengths as prefixkv's benchmarks; times are wall-clock around generate().
"""

from __future__ import annotations

import json
import random
import sys
import time


def export(out_dir: str) -> None:
    import os

    import torch
    from safetensors.torch import save_file

    from prefixkv.model.gguf_loader import load_gguf
    from prefixkv.model.loader import default_model_path, load_model

    config, state, _ = load_gguf(default_model_path())
    os.makedirs(out_dir, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in state.items() if k != "lm_head.weight"},
        os.path.join(out_dir, "model.safetensors"),
    )
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0],
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    load_model().tokenizer.hf.save_pretrained(out_dir)
    print(f"exported to {out_dir}")


def run(model_dir: str, mode: str = "on") -> None:
    from vllm import LLM, SamplingParams

    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    results = {}
    for caching in [mode == "on"]:
        llm = LLM(
            model=model_dir,
            dtype="bfloat16",
            enable_prefix_caching=caching,
            max_model_len=4096,
            seed=0,
            max_num_batched_tokens=2048,
        )
        one = SamplingParams(temperature=0, max_tokens=1)
        system = tokens(2048)
        llm.generate([{"prompt_token_ids": tokens(64)}], one, use_tqdm=False)  # warm-up

        def ttft(prompt, llm=llm, one=one):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
            return time.perf_counter() - t

        cold = ttft(system + tokens(50))
        warm = sorted(ttft(system + tokens(50)) for _ in range(3))[1]
        out32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        prefix = tokens(1024)
        shared = [{"prompt_token_ids": prefix + tokens(50)} for _ in range(32)]
        t = time.perf_counter()
        llm.generate(shared, out32, use_tqdm=False)
        shared_tok_s = 32 * 32 / (time.perf_counter() - t)
        unrelated = [{"prompt_token_ids": tokens(512)} for _ in range(32)]
        t = time.perf_counter()
        llm.generate(unrelated, out32, use_tqdm=False)
        unrelated_tok_s = 32 * 32 / (time.perf_counter() - t)
        results["on" if caching else "off"] = {
            "system_prompt_cold_s": cold,
            "system_prompt_warm_s": warm,
            "shared_prefix_output_tok_s": shared_tok_s,
            "unrelated_512_output_tok_s": unrelated_tok_s,
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    {"export": export, "run": run}[sys.argv[1]](*sys.argv[2:])
