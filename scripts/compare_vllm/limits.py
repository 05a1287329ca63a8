"""How far each row is from this machine's limit: rates measured in the run, the CPU's peak, a lower bound per row.

`python -m compare_vllm.limits --threads N --out F` (prefixkv's venv, a child process of its own, with the
comparison's thread count and prefixkv's environment, before the rounds) measures:

- memory bandwidth B (bytes/s): the best of a few passes over a 1 GiB buffer (far larger than any L3), both as a
  read (torch sum: 1 GiB moved) and as a copy (2 GiB moved: read + write); B is the faster of the two;
- the GEMM rate R (FLOP/s): torch's own BLAS paths, not prefixkv's kernels (a limit an engine's own kernels set
  would only say how far it is from itself): torch.matmul in bf16 and in fp32 on the model's four weight shapes
  (SmolLM2's, or --model's) at M = 2048 and M = 256 rows; per path and M, the rate is the four shapes' FLOPs over
  their summed best times (so each shape weighs as much as it does in one layer); R is the best of them over both
  dtypes and both M.
  prefixkv's own matmul paths are timed the same way and printed next to it (prefixkv_gemm_flops_s), not used;
- the CPU's theoretical peak P (cpu_peak): cores x GHz x FLOPs per cycle for its ISA, from lscpu, with the
  assumption spelled out in the JSON (2 FMA pipes per core, as wide as the core's vector datapath; a bf16 dot
  product instruction does twice an fp32 FMA's FLOPs; the clock lscpu reports, which under a hypervisor is the
  nominal one: a measured rate above P says the cores ran faster than that clock, and `--cpu-ghz` sets it).

The rest is plain arithmetic on the model's sizes (ModelSize: a `--model` checkpoint's from its config.json); for
the default model, SmolLM2-135M (30 layers, hidden
576, intermediate 1536, 9 heads and 3 KV heads of 64, a tied 49152 x 576 embedding that the lm_head reads):

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
from the limit a row is. The bound is that of the rates measured here (torch's best BLAS path, torch's
bandwidth): a row under 1x means an engine beat them (a faster GEMM than torch's, or a quieter machine during its
turn than during the measurement), i.e. that limit was underestimated, not broken. Each row's bound at the CPU's
peak (peak_bound: compute_s at P instead of R) is printed beside it: the ceiling no kernel can pass at that clock.
Served TTFT rows are medians: at least half the requests (all sent at once) must have their prompts prefilled
before the median request has its first token, so their bound counts the prefill of that half.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
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
class ModelSize:
    """The sizes a row's bound (and scripts/scaling.py's FLOPs) need; SMOLLM2 is the default model's (the constants
    above), and a `--model` checkpoint's come from its config.json (from_hf_config), so its rows are bounded by its
    own weights."""

    layer_shapes: tuple[tuple[int, int], ...]  # (out, in) of a layer's matmuls: q/k/v, o, gate/up, down
    layers: int
    heads: int
    head_dim: int
    head_params: int  # the lm_head's (vocab x hidden, tied or not: every logit reads it)

    @property
    def layer_params(self) -> int:
        """matmul parameters of all layers"""
        return self.layers * sum(o * i for o, i in self.layer_shapes)

    @property
    def weight_bytes(self) -> int:
        return 2 * (self.layer_params + self.head_params)  # bf16

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelSize:
        hidden, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        q_width, kv_width = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
        shapes = ((q_width + 2 * kv_width, hidden), (hidden, q_width), (2 * inter, hidden), (hidden, inter))
        return cls(shapes, cfg["num_hidden_layers"], heads, head_dim, cfg["vocab_size"] * hidden)


SMOLLM2 = ModelSize(LAYER_SHAPES, NUM_LAYERS, 9, 64, HEAD_PARAMS)


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


def time_bound(work: Work, bandwidth_bytes_s: float, gemm_flops_s: float, model: ModelSize = SMOLLM2) -> dict:
    """compute_s, memory_s and bound_s (their max) of one row's work."""
    compute = (2 * model.layer_params * work.tokens + 2 * model.head_params * work.logits) / gemm_flops_s
    memory = work.steps * model.weight_bytes / bandwidth_bytes_s
    return {"compute_s": compute, "memory_s": memory, "bound_s": max(compute, memory)}


def _in_unit(key: str, work: Work, bound_s: float) -> float:
    if key.endswith("_tok_s"):
        return work.output_tokens / bound_s
    return bound_s * 1e3 if key.endswith("_ms") else bound_s


def row_bounds(sizes: Sizes, limits: dict, model: ModelSize = SMOLLM2) -> dict[str, dict]:
    """Per row key: the bound in the row's own unit (s, ms or out tok/s) and how it was reached, for `model`'s
    weights; with the CPU's theoretical peak in `limits` (peak_flops_s), peak_bound too: the same bound with the
    peak as the GEMM rate."""
    out = {}
    for key, work in row_work(sizes).items():
        t = time_bound(work, limits["bandwidth_bytes_s"], limits["gemm_flops_s"], model)
        out[key] = {"bound": _in_unit(key, work, t["bound_s"]), **t, **dataclasses.asdict(work)}
        if limits.get("peak_flops_s"):
            peak = time_bound(work, limits["bandwidth_bytes_s"], limits["peak_flops_s"], model)
            out[key]["peak_bound"] = _in_unit(key, work, peak["bound_s"])
            out[key]["peak_compute_s"] = peak["compute_s"]
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


def _rates(
    calls: dict, rows: tuple[int, ...], repeats: int, dtype_of: dict, shapes: tuple = LAYER_SHAPES
) -> dict[str, dict[str, float]]:
    """Per path and M: the layer shapes' FLOPs over their summed best times. calls[path](m, w_index) -> a
    zero-argument call timing that shape at m rows."""
    import torch

    gen = torch.Generator().manual_seed(1)
    rates: dict[str, dict[str, float]] = {}
    for path, make in calls.items():
        rates[path] = {}
        for m in rows:
            flops = seconds = 0.0
            for j, (o, i) in enumerate(shapes):
                x = torch.randn(m, i, generator=gen).to(dtype_of[path])
                seconds += _best_time(make(x, j), repeats)
                flops += 2.0 * m * o * i
            rates[path][str(m)] = flops / seconds
    return rates


def _best(rates: dict[str, dict[str, float]]) -> tuple[str, int, float]:
    path, m = max(((p, m) for p in rates for m in rates[p]), key=lambda pm: rates[pm[0]][pm[1]])
    return path, int(m), rates[path][m]


TORCH_PATHS = {"torch.matmul bf16": "bfloat16", "torch.matmul fp32": "float32"}


def measure_gemm(repeats: int, rows: tuple[int, ...] = GEMM_ROWS, shapes: tuple = LAYER_SHAPES) -> dict:
    """torch.matmul in bf16 and fp32 (the limit: torch's BLAS, not prefixkv's kernels), and prefixkv's own matmul
    paths beside it (reported, not used by the bounds), on a layer's (out, in) weight shapes (SmolLM2's by
    default; ModelSize.layer_shapes for another model)."""
    import torch

    from prefixkv.model import matmul

    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(o, i, generator=gen).div_(i**0.5) for o, i in shapes]
    dtypes = {path: getattr(torch, name) for path, name in TORCH_PATHS.items()}
    torch_w = {path: [w.to(dt).t() for w in base] for path, dt in dtypes.items()}  # x @ W^T, as a Linear
    torch_calls = {path: (lambda x, j, ws=ws: lambda: torch.matmul(x, ws[j])) for path, ws in torch_w.items()}
    torch_rates = _rates(torch_calls, rows, repeats, dtypes, shapes)
    bf16 = [w.to(torch.bfloat16) for w in base]
    ours = matmul.available("cpu", torch.bfloat16)
    packed = {p: [matmul.pack(w, p) for w in bf16] for p in ours}
    ours_calls = {p: (lambda x, j, p=p: lambda: matmul.linear(x, bf16[j], packed[p][j], None)) for p in ours}
    ours_rates = _rates(ours_calls, rows, repeats, dict.fromkeys(ours, torch.bfloat16), shapes)
    path, m, rate = _best(torch_rates)
    own_path, own_m, own_rate = _best(ours_rates)
    return {
        "paths": list(TORCH_PATHS),
        "flops_s_by_path_and_rows": torch_rates,
        "gemm_path": path,
        "gemm_dtype": TORCH_PATHS[path].replace("bfloat16", "bf16").replace("float32", "fp32"),
        "gemm_rows": m,
        "gemm_flops_s": rate,
        "prefixkv_paths": list(ours),
        "prefixkv_flops_s_by_path_and_rows": ours_rates,
        "prefixkv_gemm_path": own_path,
        "prefixkv_gemm_rows": own_m,
        "prefixkv_gemm_flops_s": own_rate,
    }


# --- the CPU's theoretical peak (plain Python: lscpu's fields) ---


def lscpu_fields(text: str | None = None) -> dict[str, str]:
    """lscpu's "Key: value" lines (its output, or `text`); the flags from /proc/cpuinfo where lscpu lists none."""
    if text is None:
        try:
            text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if "Flags" not in fields or "CPU MHz" not in fields:
        try:
            with open("/proc/cpuinfo") as f:
                info = f.read()
        except OSError:
            info = ""
        flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
        mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
        if flags and "Flags" not in fields:
            fields["Flags"] = flags.group(1)
        if mhz and "CPU MHz" not in fields:
            fields["CPU MHz"] = mhz.group(1)
    return fields


def cpu_peak(threads: int | None = None, fields: dict[str, str] | None = None, ghz: float | None = None) -> dict:
    """The theoretical peak FLOP/s of the cores a run uses: cores x GHz x FLOPs per cycle for the CPU's ISA.

    Assumptions (written into the result): each thread gets a core of its own (min(threads, cores)); 2 FMA pipes
    per core, as wide as the core's vector datapath (AVX-512 on Intel and on AMD family 26 (Zen 5) and later:
    512 bits; AMD family 25 (Zen 3/Zen 4), which splits AVX-512 into two 256-bit halves, and AVX2-only CPUs: 256
    bits); fp32: an FMA is 2 FLOPs per lane; bf16 with AVX512_BF16 (VDPBF16PS): 2 products per fp32 lane, so twice
    fp32's FLOPs; with AMX: 1024 bf16 FLOPs per cycle per core (one TDPBF16PS, 16x16x32, per 16 cycles); without
    bf16 instructions bf16 runs as fp32. The clock: `ghz` if given, else lscpu's "CPU max MHz", else its "CPU MHz"
    (under a hypervisor the nominal clock: boost above it makes the real peak higher)."""
    f = lscpu_fields() if fields is None else fields
    flags = set(f.get("Flags", "").split())
    sockets = int(f.get("Socket(s)", "1") or 1)
    cores = sockets * int(f.get("Core(s) per socket", "0") or 0) or int(f.get("CPU(s)", "1") or 1)
    used = min(threads, cores) if threads else cores
    if ghz is not None:
        clock, source = ghz, "--cpu-ghz"
    elif f.get("CPU max MHz"):
        clock, source = float(f["CPU max MHz"]) / 1e3, "lscpu CPU max MHz"
    elif f.get("CPU MHz"):
        clock, source = float(f["CPU MHz"]) / 1e3, "lscpu CPU MHz (the nominal clock; no max listed)"
    else:
        clock, source = math.nan, "no clock listed"
    amd = "AMD" in f.get("Vendor ID", "")
    family = int(f.get("CPU family", "0") or 0)
    if "avx512f" in flags:
        bits = 256 if amd and family < 26 else 512
    elif "avx2" in flags and "fma" in flags:
        bits = 256
    else:
        bits = 128
    fp32 = 2 * (bits // 32) * 2  # 2 pipes x lanes x (multiply + add)
    if "amx_bf16" in flags:
        bf16, bf16_isa = 1024, "amx_bf16"
    elif "avx512_bf16" in flags:
        bf16, bf16_isa = 2 * fp32, "avx512_bf16"
    else:
        bf16, bf16_isa = fp32, "none (bf16 as fp32)"
    per_core_hz = clock * 1e9
    return {
        "cores": cores,
        "cores_counted": used,
        "ghz": clock,
        "clock_source": source,
        "vector_bits": bits,
        "fma_pipes": 2,
        "fp32_flops_per_cycle": fp32,
        "bf16_flops_per_cycle": bf16,
        "bf16_isa": bf16_isa,
        "fp32_peak_flops_s": used * per_core_hz * fp32,
        "bf16_peak_flops_s": used * per_core_hz * bf16,
        "peak_flops_s": used * per_core_hz * max(fp32, bf16),
        "assumption": (
            f"{used} core(s) x {clock:.2f} GHz ({source}) x {max(fp32, bf16)} FLOP/cycle (2 FMA pipes of {bits} "
            f"bits per core; bf16 via {bf16_isa})"
        ),
    }


def measure(threads: int, repeats: int, ghz: float | None = None, model: ModelSize = SMOLLM2) -> dict:
    """The machine's limits, the GEMM rate on `model`'s layer shapes."""
    import torch

    torch.set_num_threads(threads)
    result = {"threads": threads, "torch_threads": torch.get_num_threads(), "repeats": repeats}
    result.update(measure_bandwidth(repeats))
    result.update(measure_gemm(repeats, shapes=model.layer_shapes))
    result["gemm_shapes"] = [list(shape) for shape in model.layer_shapes]
    peak = cpu_peak(threads, ghz=ghz)
    result["cpu_peak"] = peak
    result["peak_flops_s"] = peak["peak_flops_s"]
    return result


def describe(limits: dict) -> str:
    """One phrase for the table's header: the bandwidth, torch's best GEMM (the bound's rate), the CPU's peak and
    prefixkv's best beside them (older results name only the one GEMM rate they measured)."""
    dtype = limits.get("gemm_dtype", "bf16")
    text = (
        f"measured limits: {limits['bandwidth_bytes_s'] / 1e9:.1f} GB/s memory, {limits['gemm_flops_s'] / 1e9:.0f} "
        f"GFLOP/s {dtype} GEMM ({limits['gemm_path']}, M={limits['gemm_rows']})"
    )
    peak = limits.get("cpu_peak")
    if peak:
        text += f"; CPU peak {peak['peak_flops_s'] / 1e9:.0f} GFLOP/s = {peak['assumption']}"
    if limits.get("prefixkv_gemm_flops_s"):
        text += (
            f"; prefixkv's best {limits['prefixkv_gemm_flops_s'] / 1e9:.0f} GFLOP/s ({limits['prefixkv_gemm_path']}, "
            f"M={limits['prefixkv_gemm_rows']}; not a limit)"
        )
    best = max(limits["gemm_flops_s"], limits.get("prefixkv_gemm_flops_s") or 0.0)
    if peak and math.isfinite(peak["peak_flops_s"]) and best > peak["peak_flops_s"]:
        implied = best / (peak["cores_counted"] * max(peak["fp32_flops_per_cycle"], peak["bf16_flops_per_cycle"]))
        text += f" (measured above that peak: the cores ran at >= {implied / 1e9:.2f} GHz, not the clock assumed)"
    return text


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m compare_vllm.limits")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5, help="best of this many timings (after one warm-up)")
    p.add_argument("--cpu-ghz", type=float, default=None, help="the clock of the CPU's peak (default: lscpu's)")
    p.add_argument("--model", default=None, help="a checkpoint directory: the GEMM rate on its shapes")
    args = p.parse_args()
    import prefixkv  # noqa: F401 - before torch, as in prefixkv's own processes: it sets OpenMP's wait policy

    model = SMOLLM2
    if args.model:
        with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
            model = ModelSize.from_hf_config(json.load(f))
    result = measure(args.threads, args.repeats, args.cpu_ghz, model)
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
