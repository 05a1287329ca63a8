"""The engine core: one step (schedule, compute, update) that the engine and the simulator both run.

A step is always the same four moves, in this order: the scheduler picks what runs (admissions, chunks,
preemptions); the components see the schedule before the forward pass (a second KV tier copies loads into the
pool and saves chunks out first); an Executor computes it (the model runner through BatchItems, or a cost model
that advances a simulated clock and makes up tokens); the scheduler records the progress, and the components see
the step once more (the tier saves what is now complete, KV events are published). What a sampled token means
(detokenizing, stop rules and outputs for the engine; metrics for the simulator) is the caller's.

The core imports no tier, event or model class: each of those is a StepComponent or an Executor, built in the
composition root (prefixkv.llm for the engine, prefixkv.sim for the simulator) and handed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixkv.batch import Sample
from prefixkv.engine.scheduler import Scheduler, SchedulerOutput
from prefixkv.request import Request


class Executor(Protocol):
    """Computes a step's schedule: one Sample per scheduled (request, tokens), in order, where the request's last
    token was computed and a token is to be sampled; None for the others (prefill chunks, prefill-only)."""

    def execute(self, scheduled: SchedulerOutput) -> Sequence[Sample | None]: ...


class StepComponent(Protocol):
    """Something that takes part in every step without being the scheduler or the executor: a second KV tier,
    the KV event publisher, a probe that records step shapes. Each hook does nothing here: a class above the
    engine package may subclass this to keep only the hooks it needs (the tier's copier and the event relay do not
    import the engine package, and spell theirs out)."""

    def on_add(self, request: Request) -> None:
        """A request was queued (a tier starts reading its chunks)."""
        return None

    def before_execute(self, scheduled: SchedulerOutput) -> None:
        """After scheduling, before the forward pass: the pages the step uses are allocated, none written yet."""
        return None

    def after_update(self, scheduled: SchedulerOutput) -> None:
        """After the scheduler recorded the step's progress (newly full pages are committed)."""
        return None

    def after_outputs(self) -> None:
        """The engine has processed the step's samples (finished requests freed, their session pins set): hand
        over what that queued (a tier's demotions)."""
        return None

    def on_reset(self) -> None:
        """The prefix cache was reset (KV events of the evictions go out)."""
        return None

    def flush(self) -> None:
        """Wait for background work handed off so far (tier writes) to be done."""
        return None

    def close(self) -> None:
        """The engine is closing: finish and release (tier writes, sockets)."""
        return None

    def stats(self) -> dict[str, Any]:
        """Fields of EngineStats this component fills (empty when none)."""
        return {}


@dataclass(slots=True)
class StepResult:
    """What one step did: the schedule (empty when nothing could run) and each scheduled item's sample."""

    scheduled: SchedulerOutput
    samples: Sequence[Sample | None]


class EngineCore:
    """The scheduler, the executor and the components, and the one step that drives them."""

    def __init__(self, scheduler: Scheduler, executor: Executor, components: Sequence[StepComponent] = ()) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.components = list(components)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        for component in self.components:
            component.on_add(request)

    def step(self) -> StepResult:
        """Schedule, compute, record. With nothing schedulable the executor still runs on the empty schedule (a
        simulator charges the step its overhead; the model runner returns at once)."""
        scheduled = self.scheduler.schedule()
        for component in self.components:
            component.before_execute(scheduled)
        samples = self.executor.execute(scheduled)
        if len(samples) != len(scheduled.scheduled):
            raise RuntimeError(f"the executor returned {len(samples)} samples for {len(scheduled.scheduled)} items")
        self.scheduler.update(scheduled, [None if s is None else s.token_id for s in samples])
        for component in self.components:
            component.after_update(scheduled)
        return StepResult(scheduled, samples)

    def after_outputs(self) -> None:
        for component in self.components:
            component.after_outputs()

    def reset(self) -> None:
        for component in self.components:
            component.on_reset()

    def flush(self) -> None:
        for component in self.components:
            component.flush()

    def close(self) -> None:
        for component in self.components:
            component.close()

    def stats(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for component in self.components:
            merged.update(component.stats())
        return merged
