"""How long one engine step takes, as a function of what the batch computes: the simulator's clock.

A step's time is linear in five features of the batch (BatchShape): a fixed part per step (the weights are
read once whatever the batch: memory-bound decode steps cost about this), a part per computed token (the dense
matmuls), a part per query x key pair of prefill chunks (attention's compute, quadratic in the context), a part
per pair of decodes (one token reading its whole context's KV: memory-bound, dearer per pair than a prefill's on
a CPU), and a part per sequence (sampling, bookkeeping). `prefixkv simulate fit` fits the five coefficients to
measured engine steps; the presets for GPU models derive them from published hardware figures, with the
derivation in `source`.

A served request also waits on work outside Engine.step: its HTTP request and the engine thread's hand-off, each
step's delivery of its tokens as server-sent events and the client's reading of them, all on the same CPUs as the
engine. The serve_* coefficients model that (`prefixkv simulate fit --serve-url` fits them against a running
server); they are 0 in the presets and in files written before them, and only a served replay charges them
(StepCostModel.served()): the engine alone, as `simulate` runs it, does not pay them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from prefixkv.request import Request

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one step computes, as the cost model sees it."""

    computed_tokens: int  # tokens run through the model this step (prefill chunk tokens + decodes)
    attended_pairs: int  # sum over chunks of query x key pairs (a chunk of n tokens from position s: n*s + n(n+1)/2)
    num_sequences: int  # requests in the batch
    num_decodes: int  # chunks of 1 token whose request is past its prompt
    decode_pairs: int = 0  # the part of attended_pairs that the decodes attend (each its whole context)
    sampled: int = 0  # items that sample a token (decodes, and chunks that end their prompt): the step's outputs

    @property
    def prefill_pairs(self) -> int:
        return self.attended_pairs - self.decode_pairs

    @classmethod
    def of(cls, scheduled: Sequence[tuple[Request, int]]) -> BatchShape:
        """The shape of SchedulerOutput.scheduled, read BEFORE Scheduler.update advances the requests (a chunk
        starts at the request's num_computed_tokens)."""
        tokens = pairs = decodes = decode_pairs = sampled = 0
        for request, n in scheduled:
            start = request.num_computed_tokens
            tokens += n
            pairs += n * start + n * (n + 1) // 2
            if n == 1 and start >= request.num_prompt_tokens:
                decodes += 1
                decode_pairs += start + 1
            if start + n >= request.num_tokens:
                sampled += 1
        return cls(tokens, pairs, len(scheduled), decodes, decode_pairs, sampled)


_COEFFICIENTS = ("step_overhead_s", "per_token_s", "per_attended_pair_s", "per_sequence_s")
SERVE_COEFFICIENTS = ("serve_per_request_s", "serve_per_step_s", "serve_per_output_token_s")


@dataclass(frozen=True)
class StepCostModel:
    """step_time = step_overhead_s + per_token_s * tokens + per_attended_pair_s * prefill pairs
    + per_decode_pair_s * decode pairs + per_sequence_s * seqs (per_decode_pair_s None: decode pairs cost
    per_attended_pair_s too, as in models written before the two were told apart).

    Every coefficient is in seconds and >= 0. `source` says where the numbers come from (a fit on which machine,
    or which published figures), so a result printed with this model can be traced back.

    The serve_* coefficients are what serving adds (see the module's docstring), charged only by served():
    serve_per_request_s once per request (before the engine sees it), serve_per_step_s per step that outputs
    tokens (waking the server's event loop and the client), serve_per_output_token_s per token output (its
    event, written and parsed)."""

    name: str
    source: str  # where the numbers come from (fit on which machine, or published figures)
    step_overhead_s: float  # per step: weights read once, launch and Python overhead
    per_token_s: float  # per computed token: the dense matmuls
    per_attended_pair_s: float  # per query x key pair: attention
    per_sequence_s: float = 0.0  # per sequence in the batch: sampling, bookkeeping
    per_decode_pair_s: float | None = None  # per query x key pair of a decode: its context's KV read
    serve_per_request_s: float = 0.0  # served only: HTTP request, parsing, the hand-off to the engine thread
    serve_per_step_s: float = 0.0  # served only: per step with outputs, the event loop's and the client's wake-up
    serve_per_output_token_s: float = 0.0  # served only: per output token, its SSE event sent and parsed

    def __post_init__(self) -> None:
        keys: tuple[str, ...] = _COEFFICIENTS + SERVE_COEFFICIENTS
        keys += ("per_decode_pair_s",) if self.per_decode_pair_s is not None else ()
        for key in keys:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model {self.name!r}: {key} must be a finite number >= 0, got {value!r}")

    @property
    def decode_pair_s(self) -> float:
        return self.per_attended_pair_s if self.per_decode_pair_s is None else self.per_decode_pair_s

    def step_time(self, batch: BatchShape) -> float:
        return (
            self.step_overhead_s
            + self.per_token_s * batch.computed_tokens
            + self.per_attended_pair_s * batch.prefill_pairs
            + self.decode_pair_s * batch.decode_pairs
            + self.per_sequence_s * batch.num_sequences
        )

    def serve_overhead_s(self, batch: BatchShape) -> float:
        """What serving adds to a step of this shape (0 without outputs)."""
        if not batch.sampled:
            return 0.0
        return self.serve_per_step_s + self.serve_per_output_token_s * batch.sampled

    def request_overhead_s(self) -> float:
        """How long after it is due a request reaches the engine: 0 for the engine alone (see served())."""
        return 0.0

    @property
    def has_serve_overhead(self) -> bool:
        return any(getattr(self, key) for key in SERVE_COEFFICIENTS)

    def served(self) -> StepCostModel:
        """This model as a served replay sees it: every step also pays serve_overhead_s, every request arrives
        serve_per_request_s late. The same model (unchanged step_time) when its serve_* coefficients are all 0."""
        if not self.has_serve_overhead:
            return self
        return ServedStepCostModel(**{f.name: getattr(self, f.name) for f in fields(self)})

    def engine_only(self) -> StepCostModel:
        """The engine's steps alone (undoes served())."""
        return self

    def scaled(self, factor: float, why: str) -> StepCostModel:
        """Every coefficient (step and serving) x factor, `why` added to the source: the same machine running
        `factor` times slower than when it was fitted (a replay's calibration measures that factor). A served()
        model stays served."""
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"cost model {self.name!r}: a scale factor must be finite and > 0, got {factor!r}")
        keys = (*_COEFFICIENTS, *SERVE_COEFFICIENTS) + (
            ("per_decode_pair_s",) if self.per_decode_pair_s is not None else ()
        )
        changes: dict = {key: getattr(self, key) * factor for key in keys}
        return replace(self, source=f"{self.source}; x{factor:.4f}: {why}", **changes)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> StepCostModel:
        """A model from to_json's dict; ValueError naming the field for anything missing, unknown or mistyped.
        A "fit" entry (the measured steps and errors `simulate fit` records beside the model) is ignored."""
        if not isinstance(d, dict):
            raise ValueError(f"a cost model must be a JSON object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if k != "fit"}
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"cost model: unknown field(s) {', '.join(unknown)} (expected {', '.join(known)})")
        missing = [k for k in ("name", "source", "step_overhead_s", "per_token_s", "per_attended_pair_s") if k not in d]
        if missing:
            raise ValueError(f"cost model: missing field(s) {', '.join(missing)}")
        for key in ("name", "source"):
            if not isinstance(d[key], str):
                raise ValueError(f"cost model: {key} must be a string, got {d[key]!r}")
        return cls(**d)


@dataclass(frozen=True)
class ServedStepCostModel(StepCostModel):
    """StepCostModel.served(): the same coefficients, the serving overhead charged (its to_json is the same)."""

    def step_time(self, batch: BatchShape) -> float:
        return super().step_time(batch) + self.serve_overhead_s(batch)

    def request_overhead_s(self) -> float:
        return self.serve_per_request_s

    def served(self) -> StepCostModel:
        return self

    def engine_only(self) -> StepCostModel:
        return StepCostModel(**{f.name: getattr(self, f.name) for f in fields(self)})


def _gpu_preset(
    name: str, gpu: str, params: float, layers: int, hidden: int, num_gpus: int, bandwidth: float, flops: float
) -> StepCostModel:
    """A dense bf16 transformer on `num_gpus` GPUs (tensor parallel), from published figures:
    step floor = weight bytes (params x 2) / aggregate HBM bandwidth (a decode step streams every weight once);
    per token = 2 x params FLOPs / (aggregate peak x MFU); per attended pair = 4 x layers x hidden FLOPs (QK^T and
    PV, a multiply-add each, over all heads) / (aggregate peak x MFU). MFU 0.5 is typical of well-tuned prefill.
    Not modelled: decode attention is memory-bound on the KV read (it costs more per pair than this compute figure
    at long contexts), tensor-parallel all-reduce time, and scheduling overhead on the host."""
    mfu = 0.5
    step = params * 2 / (num_gpus * bandwidth)
    per_token = 2 * params / (num_gpus * flops * mfu)
    per_pair = 4 * layers * hidden / (num_gpus * flops * mfu)
    source = (
        f"derived from published figures: {params / 1e9:g}B params, {layers} layers, hidden {hidden} (Meta's model "
        f"card); {num_gpus} x {gpu} at {bandwidth / 1e12:g} TB/s HBM and {flops / 1e12:g} dense bf16 TFLOPS each "
        f"(NVIDIA datasheet). step_overhead = params x 2 bytes / bandwidth = {step * 1e3:.3g} ms; per_token = "
        f"2 x params / (peak x MFU {mfu}) = {per_token * 1e6:.3g} us; per_attended_pair = 4 x layers x hidden / "
        f"(peak x MFU) = {per_pair * 1e9:.3g} ns; per_sequence 0. Ignores memory-bound decode attention, "
        "all-reduce and host overhead (optimistic for long-context decodes)."
    )
    return StepCostModel(name, source, step, per_token, per_pair, 0.0)


# SmolLM2-135M on this 2-core machine, measured: docs/benchmarks/sim_fit/fit.json (mean relative error 5.1% over 34
# step shapes; `simulate validate` TTFT ratios sim / real 0.99-1.02 on trace slices, docs/benchmarks/sim_fit).
_SMOLLM2_CPU_2T = StepCostModel(
    name="smollm2-cpu-2t",
    source=(
        "prefixkv simulate fit on this 2-core machine (AMD EPYC, 2 CPUs), 2026-11-30: SmolLM2-135M-Instruct, "
        "bfloat16, 2 threads, hash cache (page 16), max_num_batched_tokens 2048; Engine.step wall time, fastest "
        "of 5 over 34 shapes (prefill chunks of 64-2048 tokens after 0-4096 cached, decode batches of 1-64 at "
        "contexts of 128-4096, mixed); mean relative error 5.1%, max 17.4% (docs/benchmarks/sim_fit/fit.json)"
    ),
    step_overhead_s=0.026359362028125614,
    per_token_s=0.0006207600434849106,
    per_attended_pair_s=3.7752452580781867e-07,
    per_sequence_s=0.0003120654049112803,
)

H100_SXM = ("H100 SXM", 3.35e12, 989e12)
A100_SXM = ("A100 SXM 80GB", 2.039e12, 312e12)

PRESETS: dict[str, StepCostModel] = {
    m.name: m
    for m in (
        _SMOLLM2_CPU_2T,
        _gpu_preset("llama3-8b-h100", H100_SXM[0], 8.03e9, 32, 4096, 1, H100_SXM[1], H100_SXM[2]),
        _gpu_preset("llama3-8b-a100", A100_SXM[0], 8.03e9, 32, 4096, 1, A100_SXM[1], A100_SXM[2]),
        _gpu_preset("llama3-70b-h100x4", H100_SXM[0], 70.6e9, 80, 8192, 4, H100_SXM[1], H100_SXM[2]),
    )
}


def load_preset_or_file(name_or_path: str, what: str, presets: dict[str, T], parse: Callable[[object], T]) -> T:
    """A preset by name, else `parse` of a JSON file; ValueError naming `what`, the file and what was tried (the
    cost models here, the simulated tier's costs in tier.py)."""
    if name_or_path in presets:
        return presets[name_or_path]
    try:
        with open(name_or_path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"{what} {name_or_path!r} is neither a preset ({', '.join(presets)}) nor an existing JSON file"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} file {name_or_path}: cannot read it as JSON: {e}") from None
    try:
        return parse(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} file {name_or_path}: {e}") from None


def load_cost_model(name_or_path: str) -> StepCostModel:
    """A preset by name, else a JSON file (as `prefixkv simulate fit` writes). ValueError saying what was tried."""
    return load_preset_or_file(name_or_path, "cost model", PRESETS, StepCostModel.from_json)  # type: ignore[arg-type]
