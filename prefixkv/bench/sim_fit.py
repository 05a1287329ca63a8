"""`prefixkv simulate fit`: the simulator's step-cost model for this machine, fitted to steps the real engine runs.

The simulator's clock is only as good as its cost model, so the model is measured, not guessed: the real engine
(built as `prefixkv bench` builds it) runs a grid of batches that covers what a trace produces (prefill chunks of
several sizes at several context starts, decode batches of several sizes at several context lengths, and decodes
mixed with a prefill chunk), every step is timed as a whole (`Engine.step`, scheduling included: that is what a
request waits for), and the five coefficients of StepCostModel are fitted to the fastest of a few repeats of each
shape (a shared machine only ever adds time), or with `--statistic median` to the median one: on a VM whose
neighbours share its memory bandwidth the typical step is slower than the fastest (long-context decodes, which read
the whole KV, by 10-25% on the 2-core AMD EPYC here), and a long run's time is many typical steps.

A chunk's context start is set with a prefix hit: its prefix is computed once, untimed, and each timed request is
that prefix plus fresh tokens, so only the chunk runs in the timed step. Decode contexts are distinct random
prompts (sharing one prefix would take the cascade-decode path, which attends to the shared part once and so
costs less per pair than the linear model assumes). The fit minimises the relative error (each point weighted by
1 / its time), with every coefficient >= 0, so short decode steps count as much as second-long prefills.

`--serve-url URL --cost-model M` fits instead what serving adds to M (its serve_* coefficients): a request served
over HTTP and streamed also waits on the server's event loop and the client, on the same CPUs as the engine, which
Engine.step does not time. Against a running `prefixkv serve` it streams rounds of 1 and 4 concurrent requests
(fresh token-id prompts to /v1/completions, as `bench serve --trace` sends them), keeps each shape's fastest (or
median) round, simulates the same rounds with M, and fits per request, per step with outputs and per output token
what the measured times take beyond the simulated ones.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from prefixkv.bench import common
from prefixkv.bench.served_rounds import RoundTimes, ServedShape, measure_rounds, simulate_round
from prefixkv.bench.workloads import TokenSampler, sampler_for
from prefixkv.engine.core import StepComponent
from prefixkv.engine_args import engine_config
from prefixkv.sim.cost_model import BatchShape, StepCostModel, load_cost_model

# the step overhead is the constant term
STATISTICS = ("min", "median")
T = TypeVar("T")
_KEPT = {"min": "fastest", "median": "median"}
FEATURES = ("computed_tokens", "prefill_pairs", "decode_pairs", "num_sequences")
BUSY_LOAD_PER_CPU = 0.5  # load average beyond the fit's own threads, per CPU, that says other work shared the cores


@dataclass(frozen=True)
class FitGrid:
    """The batch shapes measured. Every timed shape is measured `repeats` times and the fastest time kept."""

    prefills: tuple[tuple[int, tuple[int, ...]], ...]  # (cached tokens before the chunk, sizes of lone chunks)
    decode_batches: tuple[tuple[int, tuple[int, ...]], ...]  # (context length, batch sizes of pure decode steps)
    mixed_chunks: tuple[int, ...]  # one prefill chunk of this size beside each decode batch
    repeats: int

    def describe(self) -> str:
        prefills = "; ".join(f"{list(chunks)} @ {start}" for start, chunks in self.prefills)
        decodes = "; ".join(f"{list(batches)} x ctx {ctx}" for ctx, batches in self.decode_batches)
        return (
            f"prefill chunks {prefills}; decode batches {decodes}; mixed: decodes + a chunk of "
            f"{list(self.mixed_chunks)}; {self.repeats} repeats"
        )

    def kv_tokens_needed(self) -> int:
        """Pool tokens for every cached prefix and decode context at once, plus a round's chunks and decodes
        (their pages are cached too, and must be what eviction takes, not a prefix still in use)."""
        cached = sum(start for start, _ in self.prefills)
        cached += sum(ctx * max(batches) for ctx, batches in self.decode_batches)
        chunks = sum(sum(chunks) for _, chunks in self.prefills)
        chunks += sum(len(batches) * sum(self.mixed_chunks) for _, batches in self.decode_batches)
        decodes = sum(batch * 64 for _, batches in self.decode_batches for batch in batches)
        needed = cached + chunks + decodes  # decodes: a tail page and an output page each, at most 64 tokens
        return needed + needed // 8


# Attention dominates long contexts on a CPU (a 2048-token chunk after 4096 cached tokens is ~10 M pairs, seconds
# of compute), so long starts and contexts get the small chunks and batches only: the grid spans the features
# (tokens up to 2048 per step, pairs up to ~2 M, 1-64 sequences) in under two minutes on 2 idle cores.
DEFAULT_GRID = FitGrid(
    prefills=((0, (64, 256, 1024, 2048)), (1024, (64, 256, 1024)), (4096, (64, 512))),
    decode_batches=((128, (1, 8, 32, 64)), (1024, (1, 8, 16)), (4096, (1, 2))),
    mixed_chunks=(64, 512),
    repeats=5,  # round by round over minutes: a shared machine's load comes and goes, its minimum is the cost
)
QUICK_GRID = FitGrid(
    prefills=((0, (32, 256)), (512, (32, 256))),
    decode_batches=((64, (1, 8)), (512, (1, 4))),
    mixed_chunks=(64,),
    repeats=2,
)


@dataclass(frozen=True)
class MeasuredStep:
    """One timed shape: the fastest of its repeats, with that step's own shape."""

    label: str
    shape: BatchShape
    seconds: float  # Engine.step wall time (what the simulator's clock charges per step)
    model_seconds: float  # the model runner's part of it
    repeats: int

    def to_json(self) -> dict:
        return {
            "label": self.label,
            **asdict(self.shape),
            "seconds": self.seconds,
            "model_seconds": self.model_seconds,
            "repeats": self.repeats,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="cost_model.json", help="where the fitted StepCostModel JSON goes")
    parser.add_argument("--name", default=None, help="the model's name (default: fit-<model>-<dtype>-<threads>t)")
    parser.add_argument("--quick", action="store_true", help="a small grid: seconds instead of minutes, rougher")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per shape (default: grid's)")
    parser.add_argument(
        "--statistic",
        choices=STATISTICS,
        default="min",
        help="which of a shape's repeats is fitted: min, the step without interference (a shared machine only adds "
        "time); median, the typical step, what many steps add up to where the machine's own speed varies (a VM "
        "whose neighbours share its memory bandwidth): the prediction of a long run's wall time",
    )
    common.add_engine_args(parser)
    parser.set_defaults(dtype="bfloat16")  # what serving on this CPU uses; --dtype float32 measures the exact path
    served = parser.add_argument_group("serving overhead (instead of the engine's steps)")
    served.add_argument(
        "--serve-url",
        default=None,
        help="fit the serving overhead of --cost-model against this running `prefixkv serve` (started with the "
        "engine flags given here: the simulation of its rounds uses them)",
    )
    served.add_argument("--cost-model", default=None, help="with --serve-url: the step model (a preset or JSON)")
    served.add_argument("--serve-prompt-tokens", type=int, default=512, help="each request's fresh prompt")
    served.add_argument("--serve-output-tokens", default="32,128", help="output lengths measured (comma-separated)")
    served.add_argument("--serve-concurrency", default="1,4", help="requests per round measured (comma-separated)")
    served.add_argument("--api-key", default=None, help="with --serve-url: the server's key")


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None, grid: FitGrid | None = None) -> int:
    """Measure, fit, print, write `args.output`. `grid` (tests): a grid of one's own instead of --quick's.
    With --serve-url: the serving overhead of --cost-model instead (run_served)."""
    if args.serve_url:
        return run_served(args)
    grid = grid or (QUICK_GRID if args.quick else DEFAULT_GRID)
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        grid = dataclasses.replace(grid, repeats=args.repeats)
    if args.prefix_cache == "off":
        raise ValueError(
            "simulate fit needs a prefix cache (--prefix-cache hash or radix): it sets a chunk's start "
            "with a prefix hit"
        )
    overrides = {}
    if args.kv_cache_tokens is None and args.kv_cache_memory is None:
        overrides["kv_cache_tokens"] = grid.kv_tokens_needed()
    llm = common.factory_for(args, llm_factory)(**overrides)
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    steps = measure(llm, grid, seed=0 if args.seed is None else args.seed, statistic=args.statistic)
    measure_s = time.perf_counter() - started
    load.append(os.getloadavg()[0])
    source = describe_source(llm, grid, load, args.statistic)
    model = fit(steps, name=args.name or default_name(llm), source=source)
    report = fit_report(model, steps)
    print_fit(model, report, measure_s, args.statistic)
    if max(load) - _num_threads() > BUSY_LOAD_PER_CPU * (os.cpu_count() or 1):  # beyond the fit's own threads
        print(
            f"warning: the machine was busy (1-minute load average {load[0]:.1f} -> {load[1]:.1f} on "
            f"{os.cpu_count()} CPUs): the times include waiting for a CPU; fit again on an idle machine for a preset"
        )
    fit_record = {**report, "measure_seconds": measure_s, "grid": grid.describe(), "load_average": load}
    record = {**model.to_json(), "fit": fit_record}
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(record, f, indent=2)
    print(f"cost model written to {args.output} (use it as --cost-model {args.output})")
    return 0


# -- measuring ---------------------------------------------------------------------------------------------------
class StepTimer(StepComponent):
    """Times Engine.step and records the shape of what it scheduled.

    The shape must be read between Scheduler.schedule and Scheduler.update (update advances the requests): the
    timer is a step component of the engine's core (engine/core.py), which shows it each step's schedule before
    the forward pass."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.last_shape = BatchShape(0, 0, 0, 0)
        engine.core.components.append(self)

    # the step component's hooks: before_execute records, close unhooks; the others do nothing (StepComponent's)
    def before_execute(self, scheduled) -> None:
        self.last_shape = BatchShape.of(scheduled.scheduled)

    def close(self) -> None:
        if self in self.engine.core.components:
            self.engine.core.components.remove(self)

    def step(self) -> tuple[BatchShape, float, float, list]:
        """One engine step: (its shape, wall seconds, model-runner seconds, its outputs)."""
        model_before = self.engine.get_stats().model_seconds_total
        self.last_shape = BatchShape(0, 0, 0, 0)
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        return self.last_shape, seconds, self.engine.get_stats().model_seconds_total - model_before, outputs


class _Measurer:
    """Builds each grid shape on one engine, round after round, and keeps the fastest sample of each.

    Every cached prefix and decode context is computed once, untimed, and stays cached for the whole run (the
    pool holds them all); each round then takes one sample of every shape, so a shape's samples are spread over
    the whole run and a burst of load elsewhere on a shared machine spoils one of them, not all."""

    def __init__(self, llm, grid: FitGrid, sampler: TokenSampler) -> None:
        self.engine = llm.llm_engine
        self.grid = grid
        self.sampler = sampler
        self.timer = StepTimer(llm.llm_engine)
        self._ids = itertools.count()
        self.budget = self.engine.config.max_num_batched_tokens
        self.max_seqs = self.engine.config.max_num_seqs
        self.prefixes: dict[int, list[int]] = {}  # start -> its cached prefix
        self.contexts: dict[int, list[list[int]]] = {}  # context length -> distinct cached contexts
        self.samples: dict[str, list[tuple[BatchShape, float, float]]] = {}  # label -> (shape, s, model s)

    def add(self, prompt: list[int], max_tokens: int) -> str:
        return self.engine.add_request(f"fit-{next(self._ids)}", prompt, common.greedy(max_tokens))

    def run_to_completion(self) -> None:
        """Untimed: run whatever is queued until the engine is idle."""
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def sample(self, label: str, shape: BatchShape, seconds: float, model_seconds: float, planned: bool) -> None:
        """Keep a timed step under `label` when it had the planned shape (a shorter hit than planned: dropped)."""
        samples = self.samples.setdefault(label, [])
        if planned:
            samples.append((shape, seconds, model_seconds))

    def prepare(self) -> None:
        """Compute every prefix and decode context once (untimed); their pages stay cached."""
        for start, chunks in self.grid.prefills:
            for n in chunks:
                if n > self.budget:
                    print(f"  skipped: a chunk of {n} tokens exceeds max_num_batched_tokens={self.budget}")
            self.prefixes[start] = self.sampler.tokens(start)
        for context, batches in self.grid.decode_batches:
            count = max((b for b in batches if b <= self.max_seqs), default=0)
            self.contexts[context] = [self.sampler.tokens(context) for _ in range(count)]
        to_compute = [p for p in self.prefixes.values() if p] + [c for cs in self.contexts.values() for c in cs]
        for tokens in to_compute:
            self.add(tokens + self.sampler.tokens(1), 1)
        self.run_to_completion()

    def prefill_round(self, start: int, chunks: Sequence[int]) -> None:
        """One lone prefill chunk of each size after `start` cached tokens: the cached prefix + fresh tokens."""
        for n in chunks:
            if n > self.budget:
                continue
            self.add(self.prefixes[start] + self.sampler.tokens(n), 1)
            shape, seconds, model_seconds, _ = self.timer.step()
            self.run_to_completion()  # nothing left, unless a hit was shorter than planned
            self.sample(f"prefill {n} @ {start}", shape, seconds, model_seconds, shape.computed_tokens == n)

    def decode_round(self, context: int, batches: Sequence[int]) -> None:
        """For each batch size: a pure decode step over that many distinct contexts, then the same decodes with
        one fresh prefill chunk of each mixed size beside them."""
        for batch in (b for b in batches if b <= self.max_seqs):
            mixed = [n for n in self.grid.mixed_chunks if batch + n <= self.budget and batch < self.max_seqs]
            ids = [self.add(ctx + self.sampler.tokens(1), 4 + len(mixed)) for ctx in self.contexts[context][:batch]]
            self.timer.step()  # their last prompt tokens (the hits cover the rest): the next steps are decodes
            shape, seconds, model_seconds, _ = self.timer.step()
            planned = shape.num_decodes == batch == shape.num_sequences
            self.sample(f"decode {batch} x ctx {context}", shape, seconds, model_seconds, planned)
            for n in mixed:
                self.add(self.sampler.tokens(n), 1)
                shape, seconds, model_seconds, _ = self.timer.step()
                planned = shape.num_decodes == batch and shape.computed_tokens == batch + n
                self.sample(f"decode {batch} x ctx {context} + chunk {n}", shape, seconds, model_seconds, planned)
            for rid in ids:
                self.engine.abort(rid)
            self.run_to_completion()

    def kept(self, statistic: str = "min") -> list[MeasuredStep]:
        """Per shape, in grid order, its fastest (min) or its median sample, with that sample's own shape."""
        steps = []
        for label, samples in self.samples.items():
            if samples:
                shape, seconds, model_seconds = pick(samples, statistic, key=lambda t: t[1])
                steps.append(MeasuredStep(label, shape, seconds, model_seconds, len(samples)))
        return steps


def pick(samples: Sequence[T], statistic: str, key: Callable[[T], float]) -> T:
    """The fastest sample (min) or the median one (the upper of two middle ones)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    ordered = sorted(samples, key=key)
    return ordered[0] if statistic == "min" else ordered[len(ordered) // 2]


def measure(llm, grid: FitGrid, seed: int = 0, statistic: str = "min") -> list[MeasuredStep]:
    """Run the grid on `llm`'s engine (its prefix cache is emptied before and after)."""
    sampler = sampler_for(llm, seed=seed)
    common.warmup(llm, sampler)
    measurer = _Measurer(llm, grid, sampler)
    try:
        print("computing the cached prefixes and decode contexts", flush=True)
        measurer.prepare()
        for r in range(grid.repeats):
            print(f"round {r + 1} of {grid.repeats}: every shape once", flush=True)
            for start, chunks in grid.prefills:
                measurer.prefill_round(start, chunks)
            for context, batches in grid.decode_batches:
                measurer.decode_round(context, batches)
    finally:
        measurer.timer.close()
        llm.reset_prefix_cache()
    return measurer.kept(statistic)


# -- fitting -----------------------------------------------------------------------------------------------------
def features(shape: BatchShape) -> list[float]:
    return [1.0, *(float(getattr(shape, name)) for name in FEATURES)]


def nonnegative_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """argmin ||A x - b|| subject to x >= 0, for a handful of unknowns: the optimum is the unconstrained least
    squares solution on some subset of the unknowns (the others 0), so try every subset and keep the best
    feasible one (2^5 small solves; exact, no iteration to tune)."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    b = np.asarray(targets, dtype=float)
    if a.ndim != 2 or len(a) != len(b) or len(a) == 0:
        raise ValueError("need at least one measured point to fit")
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale  # columns of similar size: attended pairs run to 1e7, the constant is 1
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), size):
            cols = list(subset)
            x_sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[cols] = x_sub
            residual = float(np.sum((a @ x - b) ** 2))
            if residual < best_residual:
                best, best_residual = x, residual
    return [float(v) for v in best / scale]


def fit(steps: Sequence[MeasuredStep], name: str, source: str) -> StepCostModel:
    """The StepCostModel with the smallest squared relative error over `steps`, every coefficient >= 0."""
    rows = [[f / s.seconds for f in features(s.shape)] for s in steps]
    overhead, per_token, per_pair, per_decode_pair, per_sequence = nonnegative_least_squares(rows, [1.0] * len(steps))
    return StepCostModel(name, source, overhead, per_token, per_pair, per_sequence, per_decode_pair)


def fit_report(model: StepCostModel, steps: Sequence[MeasuredStep]) -> dict:
    """Each point's measured and predicted time and relative error, and the error summary."""
    points = []
    for s in steps:
        predicted = model.step_time(s.shape)
        points.append({**s.to_json(), "predicted_seconds": predicted, "relative_error": predicted / s.seconds - 1})
    errors = [abs(p["relative_error"]) for p in points]
    return {
        "num_points": len(points),
        "mean_abs_relative_error": sum(errors) / len(errors) if errors else float("nan"),
        "max_abs_relative_error": max(errors, default=float("nan")),
        "points": points,
    }


def print_fit(model: StepCostModel, report: dict, measure_s: float, statistic: str = "min") -> None:
    rows = [
        [
            p["label"],
            p["computed_tokens"],
            p["attended_pairs"],
            p["num_sequences"],
            f"{p['seconds'] * 1e3:.1f}",
            f"{p['predicted_seconds'] * 1e3:.1f}",
            f"{p['relative_error']:+.1%}",
        ]
        for p in report["points"]
    ]
    common.print_table(
        ["shape", "tokens", "pairs", "seqs", "measured ms", "fitted ms", "error"],
        rows,
        title=f"measured steps ({_KEPT[statistic]} of repeats; {measure_s:.0f} s of measuring)",
    )
    print(
        f"\n{model.name}: step {model.step_overhead_s * 1e3:.3f} ms + {model.per_token_s * 1e6:.2f} us/token + "
        f"{model.per_attended_pair_s * 1e9:.4f} ns/prefill pair + {model.decode_pair_s * 1e9:.4f} ns/decode pair + "
        f"{model.per_sequence_s * 1e6:.1f} us/sequence"
    )
    print(
        f"relative error over {report['num_points']} shapes: mean {report['mean_abs_relative_error']:.1%}, "
        f"max {report['max_abs_relative_error']:.1%}"
    )


def default_name(llm) -> str:
    engine = llm.llm_engine
    model = os.path.splitext(os.path.basename(engine.model_name or "model"))[0].lower()
    return f"fit-{model}-{engine.config.dtype}-{_num_threads()}t"


def describe_source(llm, grid: FitGrid, load: Sequence[float] = (), statistic: str = "min") -> str:
    """Where the numbers come from: machine, model, dtype, threads, date, grid, and how busy the machine was."""
    engine = llm.llm_engine
    config = engine.config
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"prefixkv simulate fit on {platform.node()} ({_cpu_name()}, {os.cpu_count()} CPUs), {when}: "
        f"model {engine.model_name}, {config.dtype} on {config.device}, {_num_threads()} threads, "
        f"prefix cache {config.prefix_cache} (page {engine.kv.page_size}), max_num_batched_tokens "
        f"{config.max_num_batched_tokens}; Engine.step wall time, {_KEPT[statistic]} repeat; grid: {grid.describe()}"
        + (f"; 1-minute load average {load[0]:.1f} -> {load[-1]:.1f} while measuring" if load else "")
    )


def _num_threads() -> int:
    import torch

    return torch.get_num_threads()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- the serving overhead (--serve-url) --------------------------------------------------------------------------
SERVE_REPEATS = 5
_STEP_TERMS = ("serve_per_step_s", "serve_per_output_token_s")  # fitted to the decode phases
SLOWER_MODEL = 0.05  # an engine-only prediction this much above a served round's time: the step model is stale


def served_shapes(args: argparse.Namespace) -> list[ServedShape]:
    outputs = [int(n) for n in str(args.serve_output_tokens).split(",")]
    concurrency = [int(c) for c in str(args.serve_concurrency).split(",")]
    if min(outputs) < 2 or min(concurrency + [args.serve_prompt_tokens]) < 1:
        raise ValueError("--serve-output-tokens must be >= 2 (a decode phase); the prompt and concurrency >= 1")
    return [ServedShape(c, args.serve_prompt_tokens, n) for c in concurrency for n in outputs]


async def measure_served(
    base_url: str, shapes: Sequence[ServedShape], repeats: int, seed: int = 0, api_key: str | None = None
) -> dict[ServedShape, list[RoundTimes]]:
    """Each shape's rounds against the server at base_url (measure_rounds), after one warm-up round."""
    import httpx

    from prefixkv.bench.serve_client import Settings, stream_completion

    base = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600.0) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        settings = Settings(base, response.json()["data"][0]["id"], api_key, 0, True, 600.0)
        return await measure_rounds(client, settings, stream_completion, shapes, repeats, seed, warm_up=True)


def decode_features(config, cost: StepCostModel, shape: ServedShape) -> list[float]:
    """How many seconds each of _STEP_TERMS adds to the simulated decode phase per second of it: every request
    arrives at 0, so each adds linearly (the steps after the first token, and their outputs)."""
    engine = cost.engine_only()
    base = simulate_round(config, engine, shape).decode_s
    unit = 1e-3
    features = []
    for key in _STEP_TERMS:
        probe: dict[str, Any] = {key: unit}
        features.append(
            (simulate_round(config, dataclasses.replace(engine, **probe).served(), shape).decode_s - base) / unit
        )
    return features


def fit_serve_overhead(
    config, cost: StepCostModel, measured: dict[ServedShape, RoundTimes]
) -> tuple[StepCostModel, list[dict]]:
    """cost with its serving overhead fitted to each shape's measured round, and each shape's figures.

    Per step and per output token: from the decode phases (after the first token), minimising the relative error,
    both >= 0, so that an error of the step model on the prompt's prefill does not leak into them. Per request:
    what the measured times to the first token exceed the simulated ones by, on average (>= 0)."""
    engine = cost.engine_only()
    shapes = list(measured)
    simulated = {shape: simulate_round(config, engine, shape) for shape in shapes}
    rows, targets = [], []
    for shape in shapes:
        decode_s = measured[shape].decode_s
        rows.append([f / decode_s for f in decode_features(config, engine, shape)])
        targets.append((decode_s - simulated[shape].decode_s) / decode_s)
    per_step, per_token = nonnegative_least_squares(rows, targets)
    stepped = dataclasses.replace(engine, serve_per_step_s=per_step, serve_per_output_token_s=per_token).served()
    late = [measured[shape].ttft_s - simulate_round(config, stepped, shape).ttft_s for shape in shapes]
    model = dataclasses.replace(stepped.engine_only(), serve_per_request_s=max(0.0, statistics.fmean(late)))
    report = []
    for shape in shapes:
        served = simulate_round(config, model.served(), shape)
        m = measured[shape]
        report.append(
            {
                "label": shape.label,
                **asdict(shape),
                "ttft_seconds": m.ttft_s,
                "seconds": m.e2e_s,
                "engine_only_seconds": simulated[shape].e2e_s,
                "served_seconds": served.e2e_s,
                "engine_only_relative_error": simulated[shape].e2e_s / m.e2e_s - 1,
                "relative_error": served.e2e_s / m.e2e_s - 1,
                "decode_relative_error": served.decode_s / m.decode_s - 1,
            }
        )
    return model, report


def run_served(args: argparse.Namespace) -> int:
    """Measure the served rounds, fit the serving overhead of --cost-model, print, write `args.output` (the step
    model's coefficients and its own fit record kept, the serving overhead and its rounds added)."""
    if not args.cost_model:
        raise ValueError("--serve-url needs --cost-model: the step model whose serving overhead is fitted")
    base_model = load_cost_model(args.cost_model)
    base_record: dict = {}
    if os.path.isfile(args.cost_model):
        with open(args.cost_model) as f:
            base_record = json.load(f)
    shapes = served_shapes(args)
    repeats = args.repeats if args.repeats is not None else SERVE_REPEATS
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    config = dataclasses.replace(
        engine_config(args), kv_cache_tokens=args.kv_cache_tokens or 1 << 20, kv_cache_memory=None
    )
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    samples = asyncio.run(measure_served(args.serve_url, shapes, repeats, args.seed or 0, args.api_key))
    measure_s = time.perf_counter() - started
    load.append(os.getloadavg()[0])
    kept = {shape: pick(rounds, args.statistic, key=lambda r: r.e2e_s) for shape, rounds in samples.items()}
    model, report = fit_serve_overhead(config, base_model, kept)
    for point, shape in zip(report, shapes, strict=True):
        point["samples_seconds"] = [r.e2e_s for r in samples[shape]]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    note = (
        f"serving overhead: `prefixkv simulate fit --serve-url` on {platform.node()} ({_cpu_name()}, "
        f"{os.cpu_count()} CPUs), {when}: rounds of {', '.join(s.label for s in shapes)} streamed to "
        f"/v1/completions by the bench client (httpx), {_KEPT[args.statistic]} of {repeats}; per step and per "
        f"token fitted to the decode phases, per request to the time to first token; 1-minute load average "
        f"{load[0]:.1f} -> {load[1]:.1f}"
    )
    model = dataclasses.replace(model, source=f"{base_model.source}; {note}")
    print_served(model, report, measure_s, args.statistic)
    faster = [p["label"] for p in report if p["engine_only_relative_error"] > SLOWER_MODEL]
    if faster:
        print(
            f"warning: served rounds ran faster than the step model predicts for the engine alone ({', '.join(faster)}"
            f"): the model no longer fits this machine (its speed changed since the fit?); refit it, then this"
        )
    fit_record = dict(base_record.get("fit") or {})
    fit_record["serving"] = {"measure_seconds": measure_s, "load_average": load, "points": report}
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({**model.to_json(), "fit": fit_record}, f, indent=2)
    print(f"cost model with its serving overhead written to {args.output}")
    return 0


def print_served(model: StepCostModel, report: Sequence[dict], measure_s: float, statistic: str = "min") -> None:
    rows = [
        [
            p["label"],
            f"{p['seconds'] * 1e3:.1f}",
            f"{p['engine_only_seconds'] * 1e3:.1f}",
            f"{p['served_seconds'] * 1e3:.1f}",
            f"{p['engine_only_relative_error']:+.1%}",
            f"{p['relative_error']:+.1%}",
        ]
        for p in report
    ]
    common.print_table(
        ["round", "measured ms", "engine-only ms", "served ms", "engine-only error", "served error"],
        rows,
        title=f"served rounds (mean end-to-end per request, {_KEPT[statistic]} round; {measure_s:.0f} s of measuring)",
    )
    print(
        f"\nserving overhead: {model.serve_per_request_s * 1e3:.3f} ms/request + {model.serve_per_step_s * 1e3:.3f} "
        f"ms/step with outputs + {model.serve_per_output_token_s * 1e3:.3f} ms/output token"
    )
