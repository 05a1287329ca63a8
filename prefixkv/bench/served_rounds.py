"""Served rounds: a few requests sent together to a running server, timed as its client sees them, and the same
rounds in the simulator. What `simulate fit --serve-url` fits the serving overhead to, and what a session replay
calibrates its cost model with (the machine's speed at the time of the replay, not the fit's)."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixkv.sim.cost_model import StepCostModel

_PROMPT_IDS = (1000, 10000)  # fresh prompts: random ids any real vocabulary holds, so no prefix hits


@dataclass(frozen=True)
class ServedShape:
    """A round: `concurrency` requests sent together, each a fresh prompt of `prompt_tokens` and `output_tokens`
    generated (ignore_eos)."""

    concurrency: int
    prompt_tokens: int
    output_tokens: int

    @property
    def label(self) -> str:
        return f"{self.concurrency} x ({self.prompt_tokens} -> {self.output_tokens})"


@dataclass(frozen=True)
class RoundTimes:
    """A round's mean time to the first token and to the end of the stream, per request (seconds)."""

    ttft_s: float
    e2e_s: float

    @property
    def decode_s(self) -> float:
        """After the first token: the decode steps and their deliveries only (no prefill, no request)."""
        return self.e2e_s - self.ttft_s


@dataclass
class _TimedPrompt:
    """A simulated request of a round (simulator.TimedRequest)."""

    arrival_s: float
    output_len: int
    prompt_len: int
    first_id: int

    def prompt_tokens(self) -> list[int]:
        return list(range(self.first_id, self.first_id + self.prompt_len))


def parse_served_shapes(spec: str, what: str) -> list[ServedShape]:
    """'1x1024->32,4x256->16' (concurrency x prompt tokens -> output tokens, comma-separated); ValueError naming
    `what` (the option) and the part that is wrong."""
    shapes = []
    for part in spec.split(","):
        try:
            round_, output = part.strip().split("->")
            concurrency, prompt = round_.split("x")
            shape = ServedShape(int(concurrency), int(prompt), int(output))
        except ValueError:
            raise ValueError(f"{what}: {part.strip()!r} is not CONCURRENCYxPROMPT->OUTPUT (e.g. 4x256->16)") from None
        if shape.concurrency < 1 or shape.prompt_tokens < 1 or shape.output_tokens < 2:
            raise ValueError(f"{what}: {part.strip()!r} needs concurrency and prompt >= 1 and output >= 2")
        shapes.append(shape)
    return shapes


async def measure_rounds(
    client: Any,
    settings: Any,
    send: Callable[..., Awaitable[Any]],
    shapes: Sequence[ServedShape],
    repeats: int,
    seed: int = 0,
    warm_up: bool = False,
) -> dict[ServedShape, list[RoundTimes]]:
    """Each shape's rounds as the client sees them (sent -> first token, -> the stream's end); rounds go shape
    after shape, `repeats` times, so a burst of load elsewhere spoils one sample of a shape, not all. `send`:
    serve_client.stream_completion on `client` with `settings`; warm_up: one round first, not kept (a fresh
    server's first requests pay for lazy initialisation)."""
    rng = random.Random(seed)
    samples: dict[ServedShape, list[RoundTimes]] = {shape: [] for shape in shapes}

    async def one_round(shape: ServedShape) -> RoundTimes:
        prompts = [[rng.randrange(*_PROMPT_IDS) for _ in range(shape.prompt_tokens)] for _ in range(shape.concurrency)]
        results = await asyncio.gather(*(send(client, settings, p, shape.output_tokens) for p in prompts))
        for r in results:
            if not r.ok or r.output_tokens != shape.output_tokens:
                raise RuntimeError(f"{shape.label}: the server answered {r.error or f'{r.output_tokens} tokens'}")
        return RoundTimes(statistics.fmean(r.ttft for r in results), statistics.fmean(r.e2e for r in results))

    if warm_up:
        await one_round(shapes[-1])
    for _ in range(repeats):
        for shape in shapes:
            samples[shape].append(await one_round(shape))
    return samples


def simulate_round(config, cost: StepCostModel, shape: ServedShape) -> RoundTimes:
    """The round in the simulator: all its requests due at 0 (plus the cost model's request overhead), distinct
    prompts."""
    from prefixkv.sim.simulator import simulate_trace

    late = cost.request_overhead_s()
    requests = [
        _TimedPrompt(0.0, shape.output_tokens, shape.prompt_tokens, 1 + k * shape.prompt_tokens)
        for k in range(shape.concurrency)
    ]
    result, _ = simulate_trace(config, requests, cost)
    if any(m.latency_s is None or m.ttft_s is None for m in result.metrics):
        raise ValueError(f"{shape.label}: the simulated pool cannot hold the round (--kv-cache-tokens)")
    ttft = statistics.fmean(m.ttft_s for m in result.metrics)  # type: ignore[misc]
    return RoundTimes(ttft + late, statistics.fmean(m.latency_s for m in result.metrics) + late)  # type: ignore[misc]


def median_round(rounds: Sequence[RoundTimes]) -> RoundTimes:
    """The median round by end-to-end time (the upper of two middle ones)."""
    return sorted(rounds, key=lambda r: r.e2e_s)[len(rounds) // 2]
