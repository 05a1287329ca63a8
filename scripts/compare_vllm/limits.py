"""How far each row is from this machine's limit: two rates measured in the run, and a lower bound per row.

`python -m compare_vllm.limits --threads N --out F` (prefixkv's venv, a child process of its own, with the
comparison's thread count and prefixkv's environment, before the rounds) measures:

- memory bandwidth B (bytes/s): the best of a few passes over a 1 GiB buffer (far larger than any L3), both as a
  read (torch sum: 1 GiB moved) and as a copy (2 GiB moved: read + write); B is the faster of the two;
- the bf16 GEMM rate R (FLOP/s): every matmul path prefixkv has here (prefixkv.model.matmul.available) on
  SmolLM2's four weight shapes at M = 2048 and M = 256 rows; per path and M, the rate is the four shapes'
  FLOPs over their summed best times (so each shape weighs as much as it does in one layer); R is the best of
  them over paths and both M.

The rest is plain arithmetic on SmolLM2-135M (30 layers, hidden 576, intermediate 1536, 9 heads and 3 KV heads of
64, a tied 49152 x 576 embedding that the lm_head reads):

  P_layers = 30 * (960*576 + 576*576 + 3072*576 + 576*1536)   matmul parameters of the layers (qkv, o, gate+up,
                                                                down): 106.2 M
  P_head   = 49152 * 576                                      the lm_head: 28.3 M
  W        = 2 * (P_layers + P_head)                          bf16 bytes every forward step reads: 269 MB

A row's work is: `tokens` that go through the layers (prompt tokens nobody could have cached, plus one per output
token after the first), `logits` positions through the lm_head (one per output token) and `steps`, the fewest
forward passes any scheduler needs (each sequence needs one pass per output token; a pass emits at most
max_num_seqs tokens and takes at most max_num_batched_tokens tokens). Then

  compute_s = (2 * P_layers * tokens + 2 * P_head * logits) / R      the matmuls' FLOPs at the GEMM rate
  memory_s  = steps * W / B                                          every pass streams the weights once
  bound_s   = max(compute_s, memory_s)

Prefill-heavy rows (cold TTFT, the prefill of the throughput rows) end up on compute_s, decode-like ones (warm
TTFT, the decode of the throughput rows) on memory_s. At the measured rates each term alone is a lower bound on
the row's time, so the larger one is too; their sum would be tighter, but it is no bound when an engine runs
prefill and decode in one pass (both engines chunk prefills and batch them with decodes). Attention, sampling, the
KV cache's own traffic and everything outside the matmuls are left out: an engine at 1x would do nothing but its
matmuls. "x bound" (an engine's time over bound_s; for rates, the bound's rate over the engine's) says how far
from the limit a row is. The limit is that of the rates measured here (prefixkv's best GEMM path, torch's
bandwidth), not the datasheet's: a row under 1x means an engine beat them (a faster GEMM than prefixkv's paths, or
a quieter machine during its turn than during the measurement), i.e. the limit was underestimated, not broken.
Served TTFT rows are medians: at least half the requests (all sent at once) must have their prompts prefilled
before the median request has its first token, so their bound counts the prefill of that half.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

from compare_vllm.workloads import Sizes

NUM_LAYERS = 30
HIDDEN = 576
VOCAB = 49152
# (out, in) of each layer's matmuls: fused q/k/v (576 + 2 * 3 * 64 = 960), o, fused gate/up (2 * 1536), down
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYER_PARAMS = NUM_LAYERS * sum(o * i for o, i in LAYER_SHAPES)
HEAD_PARAMS = VOCAB * HIDDEN
WEIGHT_BYTES = 2 * (LAYER_PARAMS + HEAD_PARAMS)  # bf16
GEMM_ROWS = (2048, 256)
BANDWIDTH_BUFFER_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Work:
    """What a row makes the model do, at least: see the module docstring."""

    tokens: int  # tokens through the layers
    logits: int  # positions through the lm_head
    steps: int  # forward passes
    output_tokens: int = 0  # rate rows: the output tokens the rate counts (0 for time rows)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def generation_work(prompt_tokens: int, prompts: int, output_tokens: int, max_num_seqs: int, max_batched: int) -> Work:
    """`prompts` requests whose uncached prompt tokens total prompt_tokens, each generating output_tokens."""
    tokens = prompt_tokens + prompts * (output_tokens - 1)
    steps = max(output_tokens, _ceil_div(prompts * output_tokens, max_num_seqs), _ceil_div(tokens, max_batched))
    return Work(tokens, prompts * output_tokens, steps, prompts * output_tokens)


def first_token_work(prompt_tokens: int, prompts: int, max_num_seqs: int, max_batched: int) -> Work:
    """The first token of `prompts` requests whose uncached prompt tokens total prompt_tokens."""
    steps = max(1, _ceil_div(prompts, max_num_seqs), _ceil_div(prompt_tokens, max_batched))
    return Work(prompt_tokens, prompts, steps)


def row_work(sizes: Sizes) -> dict[str, Work]:
    """Each row's least work (keys as report.rows_for). Cached tokens count as free: the longest possible hit."""
    s = sizes
    n, out, batched = s.num_prompts, s.output_tokens, s.max_num_batched_tokens
    shared_prompt = s.shared_prefix_tokens + n * s.shared_suffix_tokens
    zero_prompt = n * s.zero_hit_tokens
    half = (n + 1) // 2  # the median of n TTFTs is no earlier than the ceil(n/2)-th first token
    offline, served = s.max_num_seqs, s.serve_max_num_seqs
    work = {
        "cold_ttft_s": first_token_work(s.system_tokens + s.question_tokens, 1, offline, batched),
        "warm_ttft_s": first_token_work(s.question_tokens, 1, offline, batched),
        "shared_prefix_tok_s": generation_work(shared_prompt, n, out, offline, batched),
        "zero_hit_tok_s": generation_work(zero_prompt, n, out, offline, batched),
        "serve_shared_tok_s": generation_work(shared_prompt, n, out, served, batched),
        "serve_shared_ttft_ms": first_token_work(
            s.shared_prefix_tokens + half * s.shared_suffix_tokens, half, served, batched
        ),
        "serve_zero_hit_tok_s": generation_work(zero_prompt, n, out, served, batched),
        "serve_zero_hit_ttft_ms": first_token_work(half * s.zero_hit_tokens, half, served, batched),
    }
    # vLLM's prefix_repetition dataset sends num_prompts // num_prefixes prompts per prefix (none: it refuses)
    per_prefix = n // s.repeated_prefixes
    if per_prefix:
        rep_n = per_prefix * s.repeated_prefixes
        rep_half = (rep_n + 1) // 2  # the median waits for as many prompts, on >= ceil(rep_half / per_prefix) prefixes
        rep_prompt = s.repeated_prefixes * s.repeated_prefix_tokens + rep_n * s.repeated_suffix_tokens
        rep_half_prompt = (
            _ceil_div(rep_half, per_prefix) * s.repeated_prefix_tokens + rep_half * s.repeated_suffix_tokens
        )
        work["serve_prefixes_tok_s"] = generation_work(rep_prompt, rep_n, out, served, batched)
        work["serve_prefixes_ttft_ms"] = first_token_work(rep_half_prompt, rep_half, served, batched)
    return work


def time_bound(work: Work, bandwidth_bytes_s: float, gemm_flops_s: float) -> dict:
    """compute_s, memory_s and bound_s (their max) of one row's work."""
    compute = (2 * LAYER_PARAMS * work.tokens + 2 * HEAD_PARAMS * work.logits) / gemm_flops_s
    memory = work.steps * WEIGHT_BYTES / bandwidth_bytes_s
    return {"compute_s": compute, "memory_s": memory, "bound_s": max(compute, memory)}


def row_bounds(sizes: Sizes, limits: dict) -> dict[str, dict]:
    """Per row key: the bound in the row's own unit (s, ms or out tok/s) and how it was reached."""
    out = {}
    for key, work in row_work(sizes).items():
        t = time_bound(work, limits["bandwidth_bytes_s"], limits["gemm_flops_s"])
        if key.endswith("_tok_s"):
            bound = work.output_tokens / t["bound_s"]
        elif key.endswith("_ms"):
            bound = t["bound_s"] * 1e3
        else:
            bound = t["bound_s"]
        out[key] = {"bound": bound, **t, **dataclasses.asdict(work)}
    return out


def times_bound(higher_is_better: bool, value: float, bound: float) -> float:
    """An engine's time over the bound's (>= 1; 1 is at the limit); nan when either is not a positive number."""
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (value, bound)):
        return math.nan
    return bound / value if higher_is_better else value / bound


# --- the measurements (run in prefixkv's venv) ---


def _best_time(fn, repeats: int) -> float:
    fn()  # warm: first-touch pages, packed weights, thread pool
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(repeats: int, size_bytes: int = BANDWIDTH_BUFFER_BYTES) -> dict:
    import torch

    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read_s = _best_time(lambda: src.sum(), repeats)
    copy_s = _best_time(lambda: dst.copy_(src), repeats)
    read, copy = size_bytes / read_s, 2 * size_bytes / copy_s
    return {
        "buffer_bytes": size_bytes,
        "read_bytes_s": read,
        "copy_bytes_s": copy,
        "bandwidth_bytes_s": max(read, copy),
    }


def measure_gemm(repeats: int, rows: tuple[int, ...] = GEMM_ROWS) -> dict:
    import torch

    from prefixkv.model import matmul

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).div_(i**0.5).to(torch.bfloat16) for o, i in LAYER_SHAPES]
    paths = matmul.available("cpu", torch.bfloat16)
    rates: dict[str, dict[str, float]] = {}
    for path in paths:
        packed = [matmul.pack(w, path) for w in weights]
        rates[path] = {}
        for m in rows:
            flops = seconds = 0.0
            for w, p in zip(weights, packed):
                x = torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16)
                seconds += _best_time(lambda x=x, w=w, p=p: matmul.linear(x, w, p, None), repeats)
                flops += 2.0 * m * w.shape[0] * w.shape[1]
            rates[path][str(m)] = flops / seconds
    best_path, best_m = max(((p, m) for p in rates for m in rates[p]), key=lambda pm: rates[pm[0]][pm[1]])
    return {
        "paths": list(paths),
        "flops_s_by_path_and_rows": rates,
        "gemm_path": best_path,
        "gemm_rows": int(best_m),
        "gemm_flops_s": rates[best_path][best_m],
    }


def measure(threads: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    result = {"threads": threads, "torch_threads": torch.get_num_threads(), "repeats": repeats}
    result.update(measure_bandwidth(repeats))
    result.update(measure_gemm(repeats))
    return result


def describe(limits: dict) -> str:
    """One phrase for the table's header."""
    return (
        f"measured limits: {limits['bandwidth_bytes_s'] / 1e9:.1f} GB/s memory, {limits['gemm_flops_s'] / 1e9:.0f} "
        f"GFLOP/s bf16 GEMM ({limits['gemm_path']}, M={limits['gemm_rows']})"
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m compare_vllm.limits")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5, help="best of this many timings (after one warm-up)")
    args = p.parse_args()
    import prefixkv  # noqa: F401 - before torch, as in prefixkv's own processes: it sets OpenMP's wait policy

    result = measure(args.threads, args.repeats)
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
