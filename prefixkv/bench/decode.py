"""`prefixkv bench decode`: decode speed of 1, 4 and 16 streams, where a decode step's time goes, and the floor.

The workload (issue 26): one request is a short question (--input-len random token ids, 50 by default) and
--output-len greedy tokens with EOS ignored (256); N streams are N such requests submitted together. Each stream
count runs --repeats times (rounds interleave the counts, so drift on a shared machine touches all of them); the
medians are reported.

Three measurements, in one run:

- Speed, uninstrumented. Decode tok/s = the output tokens after each stream's first, summed over the streams,
  divided by the time from the first stream's first token to the last stream's last token (the first token is the
  prefill's: it is TTFT, reported apart). One decode step = that window over the output tokens after the first
  (all streams decode in lockstep: each step gives every stream one token).
- The split of a decode step, in a separate pass with the same workload (so the speed above carries no
  instrumentation): torch forward pre/post hooks on the model's submodules (prefixkv/model/llama.py) and wrappers
  on a few bound methods (Engine.step, the engine core's step, the runner's execute, the model's compute_logits,
  the runner's sampler), all put on instances by this module and taken off afterwards, no model code changed.
  Every region's time is counted exclusive of the regions inside it, so the parts add up to the engine step's wall
  time by construction (hook dispatch lands in the enclosing part: mostly "rest of the model"). Only pure decode
  steps count (every scheduled request computes one token and has sampled before).
- The floor: the bytes of weights one decode step must read (every matrix the layers multiply by, the norms'
  weights and the lm_head, which is the tied embedding here; embedding rows are left out: a step reads N rows of
  it), in bf16, divided by this machine's read bandwidth on the engine's thread count. Floor ms/step = bytes /
  bandwidth; a decode step can be no shorter, whatever the stream count, so N streams' floor is N / floor tok/s.
  The KV the attention reads (it grows with streams and context) is reported beside it, not counted in the floor.
  One statistic for every floor: the best read pass (the native kernels' plain read, else a bf16 .sum(); never a
  copy, which writes too) of the interval the floor is for. The run's floor: the best read pass of the whole run
  (passes over buffers far larger than L3 before and after the decode runs, and every round's probes). A round's
  floor: the best of its own probes (RoundBandwidth: right before it, every 32nd step and right after it), since on
  a shared VM the bandwidth moves within seconds. So a round's floor is never below the run's, and both are
  printed: x floor against the run's, x round floor against each round's own (the median over the rounds).
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.paired import from_ratios, paired
from prefixkv.bench.workloads import median, random_prompts, ratio, sampler_for
from prefixkv.engine.core import StepComponent

# The parts of a decode step, in the order the plot stacks them: (key, what it covers)
PARTS: tuple[tuple[str, str], ...] = (
    (
        "scheduler",
        "scheduler and Python bookkeeping: the engine core's step outside the runner (schedule, BatchItems and "
        "page tables, update, step components)",
    ),
    ("runner_prep", "the runner outside the model: step plan, input tensors, picking the rows that sample"),
    ("embedding", "embedding lookup"),
    ("qkv_proj", "q/k/v projections, summed over layers (one fused matmul per layer)"),
    ("o_proj", "o projection, summed over layers"),
    ("gate_up_proj", "gate/up projections, summed over layers (one fused matmul per layer)"),
    ("down_proj", "down projection, summed over layers"),
    ("attention_core", "attention core: rotary, KV write, paged attention (Attention minus projections and norms)"),
    ("norms", "RMSNorms (input, post-attention, final; q/k norms where the model has them)"),
    ("rest_of_model", "rest of the model: rotary tables, SiLU x up, residual adds, the layer loop, hook dispatch"),
    ("lm_head", "lm_head (logits of the sampled rows)"),
    ("sampling", "sampling (greedy argmax, token ids to Python)"),
    (
        "detokenize_output",
        "detokenize and output: Engine.step after the core step (tokens, text, stop rules, RequestOutputs)",
    ),
)
PART_KEYS = tuple(k for k, _ in PARTS)
LINEAR_PARTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a part each, named as the model's Linears
BF16_BYTES = 2
_MISSING = object()

DEFINITIONS = {
    "decode_tok_s": "output tokens after each stream's first, summed over the streams, / (last stream's last "
    "token - first stream's first token); the first token is the prefill's (see ttft_s)",
    "per_stream_decode_tok_s": "decode_tok_s / streams",
    "decode_step_ms": "the decode window / (output tokens per stream - 1): one step gives each stream one token",
    "ttft_s": "arrival to first token, median over the streams and repeats",
    "split": "ms per pure decode step per part, mean over the decode steps of one instrumented pass; parts are "
    "exclusive (a region's time minus the regions inside it), so they sum to the instrumented Engine.step wall; "
    "the pass runs the Python layers even where the fused decode path (one native call for the layers) is on: "
    "the same kernels, which hooks can time one by one",
    "ab": "with --ab-kernel-options: a second engine with those kernel options, timed in rounds alternating with "
    "the first (each side first in half the rounds); decode_tok_s_ratio = the median of the per-round ratios this "
    "run's engine / the second (paired: every round's ratio in decode_tok_s_ratio_runs, the verdict in paired)",
    "bandwidth_bytes_s": "the run's floor bandwidth: the best read pass (native stream_read, else a bf16 .sum(); "
    "copies left out) of the run: before and after the decode runs and every round's probes (floor_bandwidth)",
    "floor_ms_per_step": "floor_bytes / bandwidth_bytes_s: the weights one decode step must read (weight_bytes_bf16; "
    "with a block weight format, bytes_read_as_stored) at the run's floor bandwidth",
    "measured_over_floor": "uninstrumented decode_step_ms / floor_ms_per_step (1 = at the memory limit)",
    "round_bandwidth_bytes_s": "a round's floor bandwidth, the same statistic over the round's own read passes: the "
    "best of those right before it, after every 32nd step of it and right after it (the mean is kept beside it)",
    "round_floor_tok_s": "per stream count, the median over the rounds of streams / (floor_bytes / that round's "
    "floor bandwidth)",
    "measured_over_round_floor": "per round, its decode_step_ms / (floor_bytes / round_bandwidth_bytes_s); the "
    "median over the rounds (speed[n].over_round_floor_runs). The probes' time inside a round is taken out of its "
    "decode window",
    "matmul_read_bytes_s": "per matmul kind: its bf16 weight bytes / its ms per step in the split (what it would "
    "stream at if it only read its weights; compare with bandwidth_bytes_s)",
    "others_cpu_share": "share of the machine's CPUs other processes kept busy during a run (/proc/stat minus this "
    "process): on a shared machine, a run with a large share is slowed by the others, not by prefixkv",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "decode", help="decode tok/s of 1/4/16 streams, the split of a decode step, and the weight-read floor"
    )
    p.add_argument("--input-len", type=int, default=50, help="prompt tokens per stream (the question)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per stream (greedy, EOS ignored)")
    p.add_argument("--streams", default="1,4,16", help="comma-separated stream counts (requests sent together)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of every stream count; medians reported")
    p.add_argument("--no-split", action="store_true", help="skip the instrumented pass (the split of a step)")
    p.add_argument(
        "--ab-kernel-options",
        default=None,
        metavar="SPEC",
        help="also time a second engine built with these --kernel-options (e.g. fused_decode=0), round by round "
        "alternating with the first, and report the ratio per stream count (a side-by-side A/B in one process)",
    )
    p.add_argument(
        "--bandwidth-mib",
        default="256,512,1024",
        help="comma-separated buffer sizes (MiB) of the bandwidth measurement; keep them well above L3",
    )
    p.add_argument("--bandwidth-repeats", type=int, default=5, help="passes per size and kind; the best counts")
    common.add_engine_args(p, defaults={"dtype": "bfloat16"})
    p.set_defaults(func=run)


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive comma-separated integers, got {text!r}")
    return values


# -- speed ------------------------------------------------------------------------------------------------------
def timed_streams(
    llm, prompts: list[list[int]], output_len: int, bandwidth: RoundBandwidth | None = None
) -> dict[str, Any]:
    """One run of len(prompts) streams from an empty cache: decode tok/s over the decode window, and TTFT; with a
    RoundBandwidth, the read bandwidth around and during the run (its probes' time taken out of the window)."""
    llm.reset_prefix_cache()
    components = llm.llm_engine.core.components
    if bandwidth is not None:
        bandwidth.start()
        components.append(bandwidth)
    cpu_before = _cpu_snapshot()
    start = time.perf_counter()
    try:
        outs = llm.generate([list(p) for p in prompts], common.greedy(output_len), use_tqdm=False)
    finally:
        if bandwidth is not None:
            components.remove(bandwidth)
    elapsed = time.perf_counter() - start
    others = _others_cpu_share(cpu_before, _cpu_snapshot())
    metrics = [o.metrics for o in outs]
    if any(m is None or m.first_token_time is None or m.finish_time is None for m in metrics):
        raise RuntimeError("a request finished without first-token and finish times")
    first = min(m.first_token_time for m in metrics if m is not None and m.first_token_time is not None)
    last = max(m.finish_time for m in metrics if m is not None and m.finish_time is not None)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    decode_tokens = sum(c - 1 for c in counts)
    window = last - first
    extra: dict[str, Any] = {}
    if bandwidth is not None:
        probes_s = bandwidth.probe_seconds_in(first, last)
        window -= probes_s
        bandwidth.probe()
        extra = {
            "round_bandwidth_bytes_s": floor_bandwidth(bandwidth.rates()),
            "round_bandwidth_mean_bytes_s": bandwidth.mean(),
            "round_read_bytes_s": bandwidth.rates(),
            "probes": len(bandwidth.samples),
            "probes_s": probes_s,
        }
    steps = max(counts) - 1
    return {
        **extra,
        "elapsed_s": elapsed,
        "output_tokens": sum(counts),
        "decode_tokens": decode_tokens,
        "decode_window_s": window,
        "decode_tok_s": ratio(decode_tokens, window),
        "decode_step_ms": ratio(window, steps) * 1e3,
        "ttft_s": [m.ttft for m in metrics if m is not None and m.ttft is not None],
        "others_cpu_share": others,
    }


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, of this process, wall seconds) from /proc; None off Linux."""
    import os

    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (sum(fields[:8]) - idle) / tick, own.user + own.system, time.monotonic()


def _others_cpu_share(before, after) -> float | None:
    """The share of the machine's CPUs that other processes kept busy between two snapshots (0: the run had the
    machine to itself; on 2 CPUs, 0.5 is a whole core taken)."""
    import os

    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / ((after[2] - before[2]) * (os.cpu_count() or 1))


def summarize_streams(n: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    tok_s = median([r["decode_tok_s"] for r in runs])
    return {
        "streams": n,
        "decode_tok_s": tok_s,
        "per_stream_decode_tok_s": tok_s / n,
        "decode_step_ms": median([r["decode_step_ms"] for r in runs]),
        "ttft_s": median([t for r in runs for t in r["ttft_s"]]),
        "output_tokens": runs[0]["output_tokens"],
        "decode_tokens": runs[0]["decode_tokens"],
        "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
        "decode_step_ms_runs": [r["decode_step_ms"] for r in runs],
        "ttft_s_runs": [median(r["ttft_s"]) for r in runs],
        "elapsed_s_runs": [r["elapsed_s"] for r in runs],
        "others_cpu_share_runs": [r["others_cpu_share"] for r in runs],
    }


# -- the split --------------------------------------------------------------------------------------------------
class StepSplit(StepComponent):
    """Exclusive wall time per part over nested regions (module hooks and method wrappers), per engine step."""

    def __init__(self) -> None:
        self._stack: list[list[float]] = []  # [start, time of the regions inside]
        self._step: dict[str, float] = defaultdict(float)
        self._decode = False
        self.totals: dict[str, float] = dict.fromkeys(PART_KEYS, 0.0)
        self.steps = 0
        self.step_wall_s = 0.0
        self.model_wall_s = 0.0  # the runner's execute, inclusive (what EngineStats.model_seconds_total counts)
        self.regions = 0  # regions entered during the counted steps (each costs a hook or wrapper call)
        self._step_regions = 0
        self._step_model_s = 0.0

    def enter(self) -> None:
        self._step_regions += 1
        self._stack.append([time.perf_counter(), 0.0])

    def exit(self, part: str) -> float:
        start, inner = self._stack.pop()
        elapsed = time.perf_counter() - start
        self._step[part] += elapsed - inner
        if self._stack:
            self._stack[-1][1] += elapsed
        return elapsed

    def hook_exit(self, part: str) -> None:
        """exit() for a forward hook, which must return None (anything else replaces the module's output)."""
        self.exit(part)

    def wrap(self, fn, part: str, on_elapsed=None):
        def timed(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.exit(part)
                if on_elapsed is not None:
                    on_elapsed(elapsed)

        return timed

    # the engine core's step component hook that tells a decode step: every request computes one token and has
    # sampled before (so it is not a one-token prompt or a prefill's last chunk)
    def before_execute(self, scheduled) -> None:
        items = scheduled.scheduled
        self._decode = bool(items) and all(n == 1 and req.num_output_tokens >= 1 for req, n in items)

    def model_done(self, elapsed: float) -> None:
        self._step_model_s += elapsed

    def step_done(self, elapsed: float) -> None:
        if self._decode:
            self.steps += 1
            self.step_wall_s += elapsed
            self.model_wall_s += self._step_model_s
            self.regions += self._step_regions
            for part, seconds in self._step.items():
                self.totals[part] += seconds
        self._step.clear()
        self._decode = False
        self._step_regions = 0
        self._step_model_s = 0.0


def _module_part(name: str, module, llama) -> str | None:
    """Which part a submodule of the model is timed as (None: not hooked, its time stays with its parent)."""
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, llama.Linear):  # an untied lm_head runs in compute_logits, never through its forward
        return leaf if leaf in LINEAR_PARTS else None
    if isinstance(module, llama.Embedding):
        return "embedding"
    if isinstance(module, llama.RMSNorm):
        return "norms"
    if isinstance(module, llama.Attention):
        return "attention_core"
    if isinstance(module, (llama.MLP, llama.DecoderLayer)) or name == "":
        return "rest_of_model"
    return None


class Instrumented:
    """Context manager: the hooks and wrappers of the split on one engine, all removed on exit."""

    def __init__(self, llm, split: StepSplit) -> None:
        self.engine = llm.llm_engine
        self.split = split
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []

    def _set(self, obj, attr: str, value) -> None:
        """obj.attr = value on the instance; __exit__ puts back what the instance had (or nothing)."""
        self._restore.append((obj, attr, vars(obj).get(attr, _MISSING)))
        setattr(obj, attr, value)

    def __enter__(self) -> Instrumented:
        from prefixkv.model import llama

        engine, split = self.engine, self.split
        runner = engine.runner
        model = runner.model
        for name, module in model.named_modules():
            part = _module_part(name, module, llama)
            if part is None:
                continue
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a: split.enter()))
            self._handles.append(module.register_forward_hook(lambda _m, _a, _o, p=part: split.hook_exit(p)))
        # the fused decode path runs the layers' kernels in one native call, which hooks cannot see into: the split
        # runs the Python layers (the same kernels, the same bits), and the A/B against fused_decode=0 says what
        # the fused call saves
        self._set(model, "fused_decode", None)
        # bound methods wrapped on the instances (an instance attribute shadows the class's method)
        self._set(engine, "step", split.wrap(engine.step, "detokenize_output", split.step_done))
        self._set(engine.core, "step", split.wrap(engine.core.step, "scheduler"))
        self._set(runner, "execute", split.wrap(runner.execute, "runner_prep", split.model_done))
        self._set(model, "compute_logits", split.wrap(model.compute_logits, "lm_head"))
        self._set(runner, "sampler", split.wrap(runner.sampler, "sampling"))
        engine.core.components.append(split)
        return self

    def __exit__(self, *exc) -> None:
        if self.split in self.engine.core.components:
            self.engine.core.components.remove(self.split)
        for obj, attr, original in reversed(self._restore):
            if original is _MISSING:
                delattr(obj, attr)  # the instance attribute goes; the class's method shows again
            else:
                setattr(obj, attr, original)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._restore.clear()


def region_cost_s(rounds: int = 2000) -> float:
    """What one timed region adds (a pre and a post hook around a module that does nothing), best of 5."""
    import torch

    split = StepSplit()
    module = torch.nn.Identity()
    module.register_forward_pre_hook(lambda _m, _a: split.enter())
    module.register_forward_hook(lambda _m, _a, _o: split.hook_exit("rest_of_model"))
    bare = torch.nn.Identity()
    x = torch.zeros(1)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            module(x)
        t1 = time.perf_counter()
        for _ in range(rounds):
            bare(x)
        t2 = time.perf_counter()
        best = min(best, ((t1 - t0) - (t2 - t1)) / rounds)
    return max(best, 0.0)


def measure_split(llm, prompts: list[list[int]], output_len: int, cost_s: float) -> dict[str, Any]:
    """The instrumented pass: ms per decode step per part."""
    split = StepSplit()
    llm.reset_prefix_cache()
    model_before = llm.llm_engine.get_stats().model_seconds_total
    cpu_before = _cpu_snapshot()
    with Instrumented(llm, split):
        llm.generate([list(p) for p in prompts], common.greedy(output_len), use_tqdm=False)
    others = _others_cpu_share(cpu_before, _cpu_snapshot())
    model_all_s = llm.llm_engine.get_stats().model_seconds_total - model_before
    steps = max(split.steps, 1)
    parts_ms = {k: split.totals[k] / steps * 1e3 for k in PART_KEYS}
    total_ms = sum(parts_ms.values())
    step_ms = split.step_wall_s / steps * 1e3
    model_ms = split.model_wall_s / steps * 1e3
    regions = split.regions / steps
    return {
        "decode_steps": split.steps,
        "parts_ms": parts_ms,
        "shares": {k: ratio(v, total_ms) for k, v in parts_ms.items()},
        "sum_ms": total_ms,
        "measured_step_ms": step_ms,
        "model_ms": model_ms,
        "engine_outside_model_ms": step_ms - model_ms,
        "model_seconds_total_all_steps_s": model_all_s,
        "regions_per_step": regions,
        "instrumentation_ms_estimate": regions * cost_s * 1e3,
        "others_cpu_share": others,
    }


# -- the floor --------------------------------------------------------------------------------------------------
def weight_bytes(model) -> dict[str, Any]:
    """The weights one decode step reads, in bf16 bytes, by kind (embedding rows left out, the lm_head in), and
    the bytes of the tensors the matmuls actually read in this runner (packed copies where there are)."""
    from prefixkv.model import llama

    by_kind: dict[str, int] = defaultdict(int)
    actual = 0
    tensors = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, llama.Linear):
            if leaf == "lm_head":
                continue  # counted below, as the lm_head read by compute_logits
            numel = module.weight.numel() + (module.bias.numel() if module.bias is not None else 0)
            by_kind[leaf] += numel * BF16_BYTES
            read = module.packed.data if module.packed is not None else module.weight
            actual += read.numel() * read.element_size()
            if module.bias is not None:
                actual += module.bias.numel() * module.bias.element_size()
            tensors += 1 + (module.bias is not None)
        elif isinstance(module, llama.RMSNorm):
            by_kind["norms"] += module.weight.numel() * BF16_BYTES
            actual += module.weight.numel() * module.weight.element_size()
            tensors += 1
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    by_kind["lm_head"] += head.numel() * BF16_BYTES
    head_read = model.lm_head_packed.data if model.lm_head_packed is not None else head
    actual += head_read.numel() * head_read.element_size()
    tensors += 1
    return {
        "weight_bytes_bf16": sum(by_kind.values()),
        "by_kind_bf16": dict(by_kind),
        "tensors": tensors,
        "lm_head_tied_to_embedding": model.lm_head is None,
        "bytes_read_as_stored": actual,
    }


def read_rates(measurement: dict[str, Any]) -> list[float]:
    """The read passes of a measure_bandwidth() result, one per size: the native plain read where it was measured,
    else the bf16 .sum() (the pass RoundBandwidth probes with); copies are left out (they write as well)."""
    return [r.get("native_read_bytes_s", r["sum_read_bytes_s"]) for r in measurement["sizes"]]


def floor_bandwidth(rates: list[float]) -> float:
    """The one statistic every floor's bandwidth is: the best read pass of the interval the floor is for (the run,
    or one round). A step can be no shorter than its weights' read at the fastest rate the machine showed then."""
    kept = [r for r in rates if isinstance(r, (int, float)) and math.isfinite(r) and r > 0]
    if not kept:
        raise ValueError("no read pass to take a floor from")
    return max(kept)


def measure_bandwidth(sizes_mib: list[int], repeats: int) -> dict[str, Any]:
    """Bytes/s of a bf16 .sum() (reads the buffer), a bf16 copy (reads and writes it: 2x its bytes) and, where the
    native kernels are built, their plain read pass (stream_read: AVX-512 loads on every thread, what a weight
    stream can get) per size, best of `repeats` passes after one untimed; bandwidth_bytes_s is floor_bandwidth of
    the read passes (read_rates), copy_bytes_s is kept for reference."""
    import torch

    stream_read = _stream_read()
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        read_s = _best_time(lambda src=src: src.sum(), repeats)
        copy_s = _best_time(lambda src=src, dst=dst: dst.copy_(src), repeats)
        row = {"mib": mib, "sum_read_bytes_s": nbytes / read_s, "copy_bytes_s": 2 * nbytes / copy_s}
        if stream_read is not None:
            row["native_read_bytes_s"] = nbytes / _best_time(lambda src=src: stream_read(src), repeats)
        rows.append(row)
        del src, dst
    result: dict[str, Any] = {"num_threads": torch.get_num_threads(), "sizes": rows}
    result["bandwidth_bytes_s"] = floor_bandwidth(read_rates(result))
    return result


def _stream_read():
    """The native read pass (prefixkv.model.native's stream_read), or None where the kernels are not built."""
    from prefixkv.model import native

    module = native.module()
    return None if module is None else module.stream_read


class RoundBandwidth(StepComponent):
    """The read bandwidth a timed round had: one read pass over a buffer (the smallest --bandwidth-mib, at most
    64 MiB) right before the round, after every `every`-th engine step of it and right after it; the round's
    floor bandwidth is the best of them (floor_bandwidth, the statistic of the run's floor too). Why during the
    round: this VM's bandwidth jumps between ~40 and ~70 GB/s for a second or two at a time (every buffer at once,
    so it is the host, not where a buffer lies), so a probe before and after a 2-second round can miss what the
    round had. The probes' own time inside the round's decode window
    (probe_seconds_in) is taken out of it."""

    def __init__(self, mib: int, every: int = 32) -> None:
        import torch

        nbytes = min(mib, 64) << 20
        self.buffer = torch.ones(nbytes // 2, dtype=torch.bfloat16)
        native_read = _stream_read()
        self.read = (lambda: native_read(self.buffer)) if native_read is not None else self.buffer.sum
        self.nbytes, self.every = nbytes, every
        self.samples: list[tuple[float, float, float]] = []  # (monotonic start, seconds, bytes/s)
        self._steps = 0
        self.read()  # first touch

    def probe(self) -> None:
        start = time.monotonic()
        t0 = time.perf_counter()
        self.read()
        seconds = time.perf_counter() - t0
        self.samples.append((start, seconds, self.nbytes / seconds))

    def after_outputs(self) -> None:
        self._steps += 1
        if self._steps % self.every == 0:
            self.probe()

    def start(self) -> None:
        self.samples.clear()
        self._steps = 0
        self.probe()

    def probe_seconds_in(self, first: float, last: float) -> float:
        return sum(seconds for start, seconds, _ in self.samples if first <= start <= last)

    def rates(self) -> list[float]:
        return [bw for _, _, bw in self.samples]

    def mean(self) -> float:
        return sum(bw for _, _, bw in self.samples) / len(self.samples)


def _best_time(fn, repeats: int) -> float:
    fn()  # first touch, thread pool
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def l3_bytes() -> int | None:
    """The L3 size sysfs reports for CPU 0 (None where it says nothing)."""
    import glob

    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/"):
        try:
            with open(path + "level") as f:
                if f.read().strip() != "3":
                    continue
            with open(path + "size") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    return None


# -- the benchmark ----------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict[str, Any]:
    streams = _ints(args.streams)
    sizes_mib = _ints(args.bandwidth_mib)
    load_before = _load_average()
    llm = common.factory_for(args, llm_factory)(prefix_cache=args.prefix_cache)
    sampler = sampler_for(llm, seed=args.seed)
    prompts = {n: random_prompts(sampler, n, args.input_len) for n in streams}
    common.warmup(llm, sampler)
    for n in streams:  # untimed: the first batch of each size pays for its allocations
        timed_streams(llm, prompts[n], min(2, args.output_len))

    other = None  # the A/B's second engine
    if args.ab_kernel_options is not None:
        factory = common.factory_for(args, llm_factory)
        other = factory(prefix_cache=args.prefix_cache, kernel_options=args.ab_kernel_options)
        common.warmup(other, sampler)
        for n in streams:
            timed_streams(other, prompts[n], min(2, args.output_len))

    bandwidth_before = measure_bandwidth(sizes_mib, args.bandwidth_repeats)
    probe = RoundBandwidth(min(sizes_mib))  # on the first engine's rounds (an A/B's ratio needs no floor)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in streams}
    other_runs: dict[int, list[dict[str, Any]]] = {n: [] for n in streams}
    order = list(streams)
    for round_index in range(max(1, args.repeats)):
        for n in order:
            pair = [(llm, runs), (other, other_runs)] if other is not None else [(llm, runs)]
            for engine, into in pair if round_index % 2 == 0 else pair[::-1]:  # each side goes first half the time
                into[n].append(timed_streams(engine, prompts[n], args.output_len, probe if engine is llm else None))
        order = order[1:] + order[:1]  # every count runs first, middle and last equally often
    del probe
    speed = {str(n): summarize_streams(n, runs[n]) for n in streams}
    ab = None
    if other is not None:
        ab = {
            "kernel_options": args.ab_kernel_options,
            "kernels": other.llm_engine.kernels,
            "speed": {str(n): summarize_streams(n, other_runs[n]) for n in streams},
        }
        # > 1: the first engine (this run's --kernel-options) decodes faster; paired round by round
        pairs = {
            str(n): paired([a["decode_tok_s"] for a in runs[n]], [b["decode_tok_s"] for b in other_runs[n]])
            for n in streams
        }
        ab["paired"] = {n: p.as_dict() for n, p in pairs.items()}
        ab["decode_tok_s_ratio_runs"] = {n: list(p.ratios) for n, p in pairs.items()}
        ab["decode_tok_s_ratio"] = {n: p.median for n, p in pairs.items()}
        del other

    split: dict[str, Any] = {}
    if not args.no_split:
        cost_s = region_cost_s()
        for n in streams:
            split[str(n)] = measure_split(llm, prompts[n], args.output_len, cost_s)
            split[str(n)]["uninstrumented_step_ms"] = speed[str(n)]["decode_step_ms"]
    bandwidth_after = measure_bandwidth(sizes_mib, args.bandwidth_repeats)

    runner: Any = llm.llm_engine.runner  # a ModelRunner (the engine types it as its ModelExecutor protocol)
    weights = weight_bytes(runner.model)
    # the run's floor: the same statistic as each round's (floor_bandwidth), over every read pass of the run
    probes = [bw for n in streams for r in runs[n] for bw in r["round_read_bytes_s"]]
    bandwidth = floor_bandwidth(read_rates(bandwidth_before) + read_rates(bandwidth_after) + probes)
    dense = runner.options.weight_format == "dense"
    # the bytes a step must read: the weights in bf16, or as stored where they are read in a block format
    floor_bytes = weights["weight_bytes_bf16"] if dense else weights["bytes_read_as_stored"]
    floor_s = floor_bytes / bandwidth
    shape = runner.config
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * BF16_BYTES
    mean_context = args.input_len + args.output_len / 2
    floor = {
        **weights,
        "floor_bytes": floor_bytes,
        "bandwidth_bytes_s": bandwidth,
        "bandwidth_before": bandwidth_before,
        "bandwidth_after": bandwidth_after,
        "l3_bytes": l3_bytes(),
        "floor_ms_per_step": floor_s * 1e3,
        "floor_tok_s": 1 / floor_s,
        "floor_tok_s_by_streams": {str(n): n / floor_s for n in streams},
        "kv_bytes_per_token_bf16": kv_per_token,
        "kv_bytes_per_step_mean_bf16": {str(n): int(n * mean_context * kv_per_token) for n in streams},
    }
    for sp in split.values():  # how fast each matmul kind streams its weights (bf16 bytes / its time)
        sp["matmul_read_bytes_s"] = {
            kind: ratio(weights["by_kind_bf16"][kind], sp["parts_ms"][kind] / 1e3)
            for kind in (*LINEAR_PARTS, "lm_head")
            if kind in weights["by_kind_bf16"]
        }
    vs_floor = {str(n): ratio(speed[str(n)]["decode_step_ms"], floor["floor_ms_per_step"]) for n in streams}
    for n in streams:  # each round against its own floor (the best read pass of its own time)
        round_floor_s = [floor_bytes / r["round_bandwidth_bytes_s"] for r in runs[n]]
        s = speed[str(n)]
        s["round_bandwidth_bytes_s_runs"] = [r["round_bandwidth_bytes_s"] for r in runs[n]]
        s["round_bandwidth_mean_bytes_s_runs"] = [r["round_bandwidth_mean_bytes_s"] for r in runs[n]]
        s["probes_runs"] = [r["probes"] for r in runs[n]]
        s["round_floor_tok_s_runs"] = [n / f for f in round_floor_s]
        s["over_round_floor_runs"] = [r["decode_step_ms"] / 1e3 / f for r, f in zip(runs[n], round_floor_s)]
    floor["round_floor_tok_s_by_streams"] = {str(n): median(speed[str(n)]["round_floor_tok_s_runs"]) for n in streams}
    vs_round_floor = {str(n): median(speed[str(n)]["over_round_floor_runs"]) for n in streams}
    results: dict[str, Any] = {
        "config": common.run_config(
            args,
            llm,
            prefix_cache=args.prefix_cache,
            input_len=args.input_len,
            output_len=args.output_len,
            streams=streams,
            repeats=args.repeats,
        ),
        "definitions": DEFINITIONS,
        "parts": dict(PARTS),
        "speed": speed,
        "split": split,
        "floor": floor,
        "measured_over_floor": vs_floor,
        "measured_over_round_floor": vs_round_floor,
        "ab": ab,
        "load_average_1_5_15": {"before": load_before, "after": _load_average()},
    }
    results["cpu"] = results["config"]["cpu"]
    results["kernels"] = results["config"]["kernels"]
    _print(results)
    return results


def _load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages: on a shared machine, above the thread count means another
    process competed for the cores (a 2-thread decode then waits for a descheduled thread in every matmul)."""
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _print(results: dict[str, Any]) -> None:
    cfg, floor = results["config"], results["floor"]
    rows = [
        (
            n,
            s["decode_tok_s"],
            s["per_stream_decode_tok_s"],
            s["decode_step_ms"],
            s["ttft_s"] * 1e3,
            floor["floor_tok_s_by_streams"][n],
            results["measured_over_floor"][n],
            floor["round_floor_tok_s_by_streams"][n],
            results["measured_over_round_floor"][n],
            " ".join("-" if x is None else f"{x:.0%}" for x in s["others_cpu_share_runs"]),
        )
        for n, s in results["speed"].items()
    ]
    common.print_table(
        [
            "streams",
            "decode tok/s",
            "per stream",
            "step ms",
            "TTFT ms",
            "floor tok/s",
            "x floor",
            "round floor tok/s",
            "x round floor",
            "others' CPU",
        ],
        rows,
        title=f"decode: {cfg['input_len']} in + {cfg['output_len']} out per stream, median of {cfg['repeats']}, "
        f"{cfg['dtype']}, {cfg['num_threads']} threads, {cfg['cpu']['model']}",
    )
    print(
        f"floor: {floor['floor_bytes'] / 1e6:.1f} MB of weights ({cfg['kernels'].get('weights', 'dense')}) per step; "
        "each floor at the best read pass of its interval"
    )
    print(
        f"  the run's: {floor['bandwidth_bytes_s'] / 1e9:.1f} GB/s = {floor['floor_ms_per_step']:.2f} ms/step "
        f"({floor['floor_tok_s']:.0f} tok/s for one stream)"
    )
    for n, s in results["speed"].items():
        bws = " / ".join(f"{b / 1e9:.1f}" for b in s["round_bandwidth_bytes_s_runs"])
        steps = " / ".join(f"{floor['floor_bytes'] / b * 1e3:.2f}" for b in s["round_bandwidth_bytes_s_runs"])
        print(
            f"  the rounds' ({n} stream(s)): {bws} GB/s = {steps} ms/step; x round floor per round "
            + " ".join(f"{x:.2f}" for x in s["over_round_floor_runs"])
        )
    print(f"load average (1/5/15 min) before / after: {results['load_average_1_5_15']}")
    ab = results["ab"]
    if ab is not None:
        pairs = {n: paired_of(ab, n) for n in results["speed"]}
        common.print_table(
            [
                "streams",
                "decode tok/s",
                f"with {ab['kernel_options']}",
                "median of per-round ratios",
                "ratio per round",
                "rounds",
            ],
            [
                (
                    n,
                    s["decode_tok_s"],
                    ab["speed"][n]["decode_tok_s"],
                    f"{pairs[n].median:.3f}",
                    pairs[n].per_round(3),
                    pairs[n].verdict,
                )
                for n, s in results["speed"].items()
            ],
            title="A/B, rounds alternating in one process (> 1: this run's kernel options decode faster)",
        )
    for n, sp in results["split"].items():
        headers = ["part", "ms/step", "share"]
        body: list[tuple[Any, ...]] = [(k, sp["parts_ms"][k], f"{sp['shares'][k]:.1%}") for k in PART_KEYS]
        body.append(("sum", sp["sum_ms"], ""))
        body.append(("measured step (instrumented)", sp["measured_step_ms"], ""))
        body.append(("measured step (uninstrumented)", sp["uninstrumented_step_ms"], ""))
        body.append(("floor", floor["floor_ms_per_step"], ""))
        body.append(("instrumentation (estimate, inside the parts)", sp["instrumentation_ms_estimate"], ""))
        rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in sp["matmul_read_bytes_s"].items())
        others = "-" if sp["others_cpu_share"] is None else f"{sp['others_cpu_share']:.0%}"
        title = f"split of a decode step, {n} stream(s), {sp['decode_steps']} steps, others' CPU {others}"
        common.print_table(headers, body, title=title)
        print(f"weights streamed per matmul kind, GB/s: {rates}")


def paired_of(ab: dict[str, Any], n: str):
    """The A/B's paired comparison at n streams, from its per-round ratios (a stored result's too)."""
    return from_ratios(ab["decode_tok_s_ratio_runs"][n])


def plot(results: dict[str, Any], png_path: str) -> None:
    """Left: decode tok/s per stream count with the floor; right: the split of a decode step, stacked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, floor = results["config"], results["floor"]
    counts = list(results["speed"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.3]})
    xs = range(len(counts))
    measured = [results["speed"][n]["decode_tok_s"] for n in counts]
    floors = [floor["floor_tok_s_by_streams"][n] for n in counts]
    # the rounds' own floors (each at its round's best read pass), the median over the rounds
    round_floors = [
        floor["round_floor_tok_s_by_streams"][n]
        if "round_floor_tok_s_by_streams" in floor
        else v * results["measured_over_round_floor"][n]
        for n, v in zip(counts, measured)
    ]
    ax.bar(xs, measured, color="tab:blue", label="measured decode tok/s (median)")
    ax.plot(xs, floors, color="tab:red", marker="o", label="floor: weights / the run's best read pass")
    ax.plot(xs, round_floors, color="tab:orange", marker="s", label="round floor: at each round's best read pass")
    for x, n, v in zip(xs, counts, measured):
        label = f"{v:.0f}\n{results['measured_over_round_floor'][n]:.2f}x round floor"
        ax.annotate(f"{label}\n{results['measured_over_floor'][n]:.2f}x floor", (x, v), ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{n} stream{'s' if n != '1' else ''}" for n in counts])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens / s (all streams)")
    ax.set_title(f"decode tok/s ({cfg['dtype']}, {cfg['num_threads']} threads)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")

    split = results["split"]
    if split:
        cmap = plt.get_cmap("tab20")
        names = list(split)
        bottoms = [0.0] * len(names)
        for i, key in enumerate(PART_KEYS):
            values = [split[n]["parts_ms"][key] for n in names]
            bx.bar(range(len(names)), values, bottom=bottoms, color=cmap(i), label=key)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        bx.scatter(
            range(len(names)),
            [split[n]["uninstrumented_step_ms"] for n in names],
            color="black",
            marker="_",
            s=400,
            zorder=3,
            label="step without instrumentation",
        )
        bx.axhline(floor["floor_ms_per_step"], color="tab:red", linestyle="--", label="floor")
        bx.set_xticks(range(len(names)), [f"{n} stream{'s' if n != '1' else ''}" for n in names])
        bx.set_ylabel("ms per decode step")
        bx.set_title("where a decode step's time goes (instrumented pass)", fontsize=10)
        handles, labels = bx.get_legend_handles_labels()
        bx.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"prefixkv bench decode: {cfg['model']}, {cfg['cpu']['model']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
