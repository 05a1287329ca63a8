"""Production request traces (Mooncake, Qwen-Bailian): load, validate, rescale, and turn into token prompts.

A trace has no text: each prompt is a list of block hash ids (equal leading ids = a shared prefix). To drive a
real cache we give every id a fixed run of token ids, so two prompts share exactly the token prefix the trace says
they share, and we can shrink blocks (512 -> 16 tokens) to replay an hour of traffic on a small model. The
loaders reject a malformed line with the file, line number and field, because a silently skipped request would
change every hit rate computed downstream. See docs/traces.md.
"""

from __future__ import annotations

import json
import math
import operator
import random
from dataclasses import dataclass, field

import numpy as np

FORMATS = {"mooncake": 512, "bailian": 16}  # format name -> the block size its hash ids stand for
_REQUIRED = {
    "mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
    "bailian": ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "turn", "hash_ids"),
}
_SECONDS_PER_UNIT = {"mooncake": 0.001, "bailian": 1.0}  # Mooncake stamps are milliseconds, Bailian's seconds


class TraceFormatError(ValueError):
    """A trace line that is not what its format says; the message names the file, line number and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds from the first request
    input_length: int  # prompt tokens at the trace's own block size
    output_length: int
    block_ids: tuple[int, ...]  # one hash id per block of `Trace.block_size` tokens (the last may be partial)
    session: str | None = None  # chat id (bailian), None for mooncake


@dataclass
class Trace:
    path: str
    format: str
    block_size: int
    requests: list[TraceRequest]


def detect_format(first: dict) -> str | None:
    """Bailian lines carry a chat id; Mooncake lines have the hash ids and a timestamp and no chat id."""
    if "chat_id" in first:
        return "bailian"
    if "hash_ids" in first and "timestamp" in first:
        return "mooncake"
    return None


def load_trace(path: str, format: str | None = None, limit: int | None = None) -> Trace:
    """Read a JSON-lines trace (`format` None: detected from the first line), at most `limit` requests.

    Every line is checked (fields present and typed, lengths >= 0, one hash id per started block). Requests are
    put in arrival order with a stable sort (a trace written out of order still replays in time order, ties keep
    the file's order); arrival times become seconds from the earliest request. Blank lines are skipped.
    """
    if format is not None and format not in FORMATS:
        raise TraceFormatError(f"{path}: unknown trace format {format!r} (known: {', '.join(FORMATS)})")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    rows: list[tuple[float, TraceRequest]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            obj = _parse_line(path, lineno, line)
            if format is None:
                format = detect_format(obj)
                if format is None:
                    raise TraceFormatError(
                        f"{path}:{lineno}: neither a mooncake line (timestamp, input_length, output_length, "
                        f"hash_ids) nor a bailian line (chat_id, ...): fields are {sorted(obj)}"
                    )
            rows.append(_parse_request(path, lineno, obj, format))
    if format is None or not rows:
        raise TraceFormatError(f"{path}: no requests in the file")
    rows.sort(key=operator.itemgetter(0))
    first = rows[0][0]
    unit = _SECONDS_PER_UNIT[format]
    requests = [_rebased(r, (t - first) * unit) for t, r in rows]
    return Trace(path=path, format=format, block_size=FORMATS[format], requests=requests)


def _rebased(r: TraceRequest, arrival_s: float) -> TraceRequest:
    return TraceRequest(arrival_s, r.input_length, r.output_length, r.block_ids, r.session)


def _parse_line(path: str, lineno: int, line: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _parse_request(path: str, lineno: int, obj: dict, format: str) -> tuple[float, TraceRequest]:
    """(raw timestamp, request with arrival 0) from one line; raises TraceFormatError naming the field."""

    def bad(name: str, why: str) -> TraceFormatError:
        return TraceFormatError(f"{path}:{lineno}: field {name!r} {why} ({format} format)")

    for name in _REQUIRED[format]:
        if name not in obj:
            raise bad(name, "is missing")

    def count(name: str) -> int:
        value = obj[name]
        if type(value) is not int:
            raise bad(name, f"must be an integer, got {value!r}")
        if value < 0:
            raise bad(name, f"must be >= 0, got {value}")
        return value

    stamp = obj["timestamp"]
    if type(stamp) not in (int, float) or not math.isfinite(stamp):
        raise bad("timestamp", f"must be a finite number, got {stamp!r}")
    input_length, output_length = count("input_length"), count("output_length")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int and h >= 0 for h in ids):
        raise bad("hash_ids", "must be a list of integers >= 0")
    block_size = FORMATS[format]
    expected = -(-input_length // block_size)
    if len(ids) != expected:
        raise bad(
            "hash_ids",
            f"has {len(ids)} ids but input_length {input_length} needs {expected} blocks of {block_size} tokens",
        )
    session = None
    if format == "bailian":
        for name in ("chat_id", "parent_chat_id"):
            if type(obj[name]) not in (int, str):
                raise bad(name, f"must be an integer or a string, got {obj[name]!r}")
        count("turn")
        session = str(obj["chat_id"])
    return float(stamp), TraceRequest(0.0, input_length, output_length, tuple(ids), session)


@dataclass(frozen=True)
class TraceScaling:
    """How a trace is replayed: block length in tokens, load (time), output lengths and which slice."""

    tokens_per_block: int | None = None  # None: the trace's own block size (full length, every token)
    time_scale: float = 1.0  # multiplies arrival times: 2.0 = half the load, 0.5 = twice the load, 0 = all at once
    output_scale: float | None = None  # None: scale output lengths by the same factor as prompts
    max_requests: int | None = None  # the first N requests of the time window
    start_s: float = 0.0  # the window starts here (trace seconds, before time scaling)
    duration_s: float | None = None  # and lasts this long (None: to the end)

    def __post_init__(self) -> None:
        if self.tokens_per_block is not None and self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.output_scale is not None and not (math.isfinite(self.output_scale) and self.output_scale > 0):
            raise ValueError(f"output_scale must be > 0, got {self.output_scale}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"start_s must be >= 0, got {self.start_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    def block_tokens(self, block_size: int) -> int:
        return self.tokens_per_block or block_size

    def output_factor(self, block_size: int) -> float:
        return self.output_scale if self.output_scale is not None else self.block_tokens(block_size) / block_size

    def describe(self, block_size: int | None = None) -> str:
        """One line for every result, e.g. "512->16 tokens/block, time x1.0, output x0.03125, all requests"."""
        if block_size is None:
            blocks = f"{self.tokens_per_block or 'trace'} tokens/block"
            output = f"output x{self.output_scale}" if self.output_scale is not None else "output as prompts"
        else:
            blocks = f"{block_size}->{self.block_tokens(block_size)} tokens/block"
            output = f"output x{self.output_factor(block_size):g}"
        window = "all requests"
        if self.start_s or self.duration_s is not None:
            end = f"{self.start_s + self.duration_s:g}" if self.duration_s is not None else "end"
            window = f"trace seconds {self.start_s:g}-{end}"
        if self.max_requests is not None:
            window = f"first {self.max_requests} requests of {window}"
        return f"{blocks}, time x{self.time_scale:g}, {output}, {window}"


class BlockTokens:
    """Hash id -> its fixed run of token ids: the id's base-V digits first, then seeded pseudo-random filler.

    The digits make two different ids' runs differ (already in their first token unless the ids are equal modulo
    V, and then in the second), so a shared token prefix is a shared block prefix, give or take that one token
    (docs/traces.md says when it can matter). Runs are computed, not stored:
    the full Mooncake trace is ~145M prompt tokens, so a prompt is built when asked for, from a table of int
    objects shared by every prompt (8 bytes a token).
    """

    def __init__(self, tokens_per_block: int, max_id: int, seed: int = 0, vocab: tuple[int, int] = (100, 49_000)):
        low, high = vocab
        if not 0 <= low < high:
            raise ValueError(f"vocab must be a range (low, high) with 0 <= low < high, got {vocab}")
        self.tokens_per_block = tokens_per_block
        self.low, self.radix = low, high - low
        self.num_digits = 1
        while self.radix**self.num_digits <= max_id:
            self.num_digits += 1
        if self.num_digits > tokens_per_block:
            raise ValueError(
                f"{tokens_per_block} tokens per block give only {self.radix**tokens_per_block} distinct runs over "
                f"a vocabulary of {self.radix}, and the trace has ids up to {max_id}: use more tokens per block"
            )
        rng = random.Random(seed)
        multiplier = rng.randrange(1, self.radix)
        while math.gcd(multiplier, self.radix) != 1:  # a bijection on digits keeps distinct ids distinct
            multiplier = rng.randrange(1, self.radix)
        self.multiplier = multiplier
        self.offsets = [rng.randrange(self.radix) for _ in range(self.num_digits)]
        self.seed_mix = np.uint64(rng.getrandbits(64))
        self.ints = list(range(high))  # shared int objects: a prompt list holds pointers into this table

    def tokens(self, block_ids: tuple[int, ...], length: int) -> list[int]:
        """The first `length` tokens of the concatenated runs of `block_ids`."""
        ids = np.asarray(block_ids, dtype=np.uint64)
        cols = np.arange(self.tokens_per_block, dtype=np.uint64)
        x = ids[:, None] * np.uint64(0x9E3779B97F4A7C15) + cols[None, :] * np.uint64(0xBF58476D1CE4E5B9)
        x ^= self.seed_mix
        x ^= x >> np.uint64(31)  # splitmix64's finaliser: cheap, well mixed, deterministic
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
        runs = (x % np.uint64(self.radix)).astype(np.int64)
        digits = ids.astype(np.int64)
        for k in range(self.num_digits):
            runs[:, k] = (digits % self.radix * self.multiplier + self.offsets[k]) % self.radix
            digits //= self.radix
        flat = (runs.ravel()[:length] + self.low).tolist()
        return list(map(self.ints.__getitem__, flat))


@dataclass(slots=True)
class ScaledRequest:
    arrival_s: float
    output_len: int
    session: str | None
    prompt_len: int
    block_ids: tuple[int, ...] = ()  # the trace's ids; block i is tokens [i*T, (i+1)*T) with T tokens_per_block
    tokens_per_block: int = 1
    block_tokens: BlockTokens | None = field(default=None, repr=False)

    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids, built on demand (never hold all of a long trace's prompts at once)."""
        if self.block_tokens is None:
            raise ValueError("this request has no token mapping (made by scale_trace)")
        return self.block_tokens.tokens(self.block_ids, self.prompt_len)


def scaled_length(length: int, block_size: int, tokens_per_block: int) -> int:
    """Full blocks keep tokens_per_block tokens each; a partial last block keeps its share, rounded, >= 1."""
    full, partial = divmod(length, block_size)
    kept = max(1, round(partial * tokens_per_block / block_size)) if partial else 0
    return full * tokens_per_block + kept


def scale_trace(
    trace: Trace, scaling: TraceScaling, seed: int = 0, vocab: tuple[int, int] = (100, 49_000)
) -> list[ScaledRequest]:
    """The slice of `trace` that `scaling` selects, with lengths and times rescaled and prompts mapped to tokens.

    Arrival times are rebased to the first selected request and multiplied by time_scale; prefix structure and
    order are kept. Output lengths are rounded and at least 1. A request with an empty prompt is an error (no
    engine serves one).
    """
    block_size = trace.block_size
    per_block = scaling.block_tokens(block_size)
    out_factor = scaling.output_factor(block_size)
    end = scaling.start_s + scaling.duration_s if scaling.duration_s is not None else math.inf
    chosen = [r for r in trace.requests if scaling.start_s <= r.arrival_s < end]
    if scaling.max_requests is not None:
        chosen = chosen[: scaling.max_requests]
    if not chosen:
        raise ValueError(f"{trace.path}: no requests in the slice ({scaling.describe(block_size)})")
    # over the whole trace, so a slice maps every id to the same run as the full trace does
    max_id = max((max(r.block_ids) for r in trace.requests if r.block_ids), default=0)
    mapping = BlockTokens(per_block, max_id, seed=seed, vocab=vocab)
    origin = chosen[0].arrival_s
    scaled: list[ScaledRequest] = []
    for i, r in enumerate(chosen):
        if r.input_length == 0:
            raise ValueError(f"{trace.path}: request {i} of the slice has an empty prompt (input_length 0)")
        scaled.append(
            ScaledRequest(
                arrival_s=(r.arrival_s - origin) * scaling.time_scale,
                output_len=max(1, round(r.output_length * out_factor)),
                session=r.session,
                prompt_len=scaled_length(r.input_length, block_size, per_block),
                block_ids=r.block_ids,
                tokens_per_block=per_block,
                block_tokens=mapping,
            )
        )
    return scaled
