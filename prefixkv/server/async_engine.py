"""One thread owns the engine (an EngineClient); every HTTP handler talks to it through a command queue.

Why a thread: Engine.step() is a blocking forward pass, so it cannot run on the event loop without stalling
every connection. Why a command queue rather than a lock: add_request / abort / get_stats then never wait for a
whole forward pass while holding the event loop; the engine thread runs them between two steps. Requests that
arrive during a step are all admitted before the next one, so many connections share each batch.

Outputs go back to the event loop with call_soon_threadsafe, one call per step per event loop. The engine
thread never tokenizes a request's text: handlers submit token ids (state.py tokenizes in a worker thread).

The engine never builds cumulative outputs for the server (each would copy all text and logprobs so far, every
step: O(n^2) in the output length). A stream asks for `delta` outputs (only what each step added), a plain
request for `final_only` (one whole output at the end); both add up the same way (see _coalesce, _Sink.count).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from prefixkv.engine.client import EngineClient, Prompt
from prefixkv.engine.metrics import EngineStats
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from prefixkv.request_options import RequestOptions

logger = logging.getLogger(__name__)

_STOP = object()
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop crashed or was stopped; nothing more will be served."""


@dataclass
class FinishedRequest:
    """What the metrics need of a finished engine request. Its last output cannot tell: a delta holds only
    the last step's tokens, and only the completions that changed in it."""

    metrics: RequestMetrics | None
    finish_reasons: list[str]  # one per completion, in completion order
    num_generated_tokens: int  # of its longest completion


@dataclass
class _Sink:
    """Where the outputs of one engine request go (the RequestGroup of the HTTP request that owns it), and
    what they added up to so far, for FinishedRequest."""

    loop: asyncio.AbstractEventLoop
    group: RequestGroup
    index: int  # position of this engine request inside its HTTP request (prompt number)
    num_generated: dict[int, int] = field(default_factory=dict)  # tokens per completion index
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def count(self, output: RequestOutput) -> None:
        for c in output.outputs:
            self.num_generated[c.index] = self.num_generated.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason

    def finished(self, output: RequestOutput) -> FinishedRequest:
        return FinishedRequest(
            output.metrics,
            [self.finish_reasons[i] for i in sorted(self.finish_reasons)],
            max(self.num_generated.values(), default=0),
        )


class StreamBacklogError(RuntimeError):
    """The reader of a group fell more than max_backlog outputs behind: its requests were aborted."""


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt), read as one stream of (index, output).

    Iterating yields, per prompt, what the engine sent since the reader last took that prompt's output, until
    every request is finished: the deltas of a stream, or the one whole output of a final_only request.
    close() aborts whatever has not finished: handlers call it in `finally`, so a client that goes away frees
    its pages.

    The group holds at most one unread output per prompt: deltas the reader has not taken yet are folded into
    it (see _coalesce) rather than queued one per step, so what it holds is what the client has not been sent.
    A reader more than max_backlog outputs behind on any prompt (a client that stopped reading) gets its
    requests aborted and `stopped` set, which sse.py uses to drop the connection; that bounds the memory.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], max_backlog: int | None = None) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.max_backlog = max_backlog
        self.unfinished: set[int] = set(range(len(request_ids)))
        self._unread: dict[int, RequestOutput] = {}  # newest unread output per prompt, oldest prompt first
        self._behind: dict[int, int] = {}  # outputs folded into _unread[index] since the reader took it
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.stopped = asyncio.Event()  # set when the group ends early: cut, backlog overflow, engine failure

    # -- filled by the engine (through the event loop) ------------------------------------------------------
    def put(self, index: int, output: RequestOutput) -> None:
        if index not in self.unfinished or self._error is not None:  # closed or aborted: nobody listens
            return
        self._unread[index] = _coalesce(self._unread.get(index), output)
        behind = self._behind[index] = self._behind.get(index, 0) + 1
        self._ready.set()
        if self.max_backlog is not None and behind > self.max_backlog and not output.finished:
            logger.warning(
                "aborting %s: its client is %d outputs behind (--max-stream-queue)", self.request_ids[index], behind
            )
            self.fail(StreamBacklogError(f"the client fell {behind} outputs behind; request aborted"), abort=True)

    def fail(self, exc: BaseException, *, abort: bool) -> None:
        """End the group with exc (raised to the reader); abort=False when the engine already dropped it."""
        if self._error is not None:
            return
        if abort:
            self.close()
        self.unfinished.clear()
        self._unread.clear()
        self._error = exc
        self._ready.set()
        self.stopped.set()

    # -- read by the HTTP handler ----------------------------------------------------------------------------
    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while True:
            if self._unread:
                index = next(iter(self._unread))
                output = self._unread.pop(index)
                self._behind[index] = 0
                if output.finished:
                    self.unfinished.discard(index)
                return index, output
            if self._error is not None:
                raise self._error
            if not self.unfinished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    async def collect(self) -> list[RequestOutput]:
        """Wait for the final output of every request, in prompt order."""
        finals: list[RequestOutput | None] = [None] * len(self.request_ids)
        async for index, output in self:
            finals[index] = output
        return finals  # type: ignore[return-value]

    def close(self) -> None:
        if self.unfinished:
            self.engine.abort_nowait([self.request_ids[i] for i in sorted(self.unfinished)])
            self.unfinished.clear()


def _coalesce(unread: RequestOutput | None, newer: RequestOutput) -> RequestOutput:
    """Fold a newer delta output into the unread one. Per completion index, token ids, text and logprobs
    concatenate; the rest (finish and stop reason, cumulative logprob, metrics, cached tokens and cache writes,
    which every output carries whole) is the newer's.
    With n > 1 a delta lists only the completions that changed. Builds new lists rather than extending the
    engine's (so nothing handed over changes); that costs the unread size, which max_backlog bounds."""
    if unread is None:
        return newer
    merged = {c.index: c for c in unread.outputs}
    for c in newer.outputs:
        old = merged.get(c.index)
        if old is not None:
            c = CompletionOutput(
                index=c.index,
                text=old.text + c.text,
                token_ids=old.token_ids + c.token_ids,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=None if c.logprobs is None else (old.logprobs or []) + c.logprobs,
                cumulative_logprob=c.cumulative_logprob,
            )
        merged[c.index] = c
    return replace(newer, outputs=[merged[i] for i in sorted(merged)])


class AsyncEngine:
    """Wraps a (not thread-safe) engine for asyncio callers, with the EngineClient's questions as typed coroutines
    answered on the engine thread between two steps. Start with start(), end with shutdown()."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        on_finished: Callable[[FinishedRequest], None] | None = None,
        on_aborted: Callable[[int], None] | None = None,
        max_backlog: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_backlog = max_backlog  # see RequestGroup
        self._groups: weakref.WeakSet[RequestGroup] = weakref.WeakSet()  # live groups, touched on the event loop
        self.on_finished = on_finished  # called on the engine thread as each engine request finishes (metrics)
        self.on_aborted = on_aborted  # called with the number of requests aborted before they finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # touched only on the engine thread
        self._thread = threading.Thread(target=self._run, name="prefixkv-engine", daemon=True)
        self._dead: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()  # the step components: the KV event publisher's sockets, the tier's last writes

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # -- the asyncio side ----------------------------------------------------------------------------------
    async def _call(self, fn: Callable[[EngineClient], T]) -> T:
        """Run fn(engine) on the engine thread between two steps and return its result (or raise its error)."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self._dead!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    # -- the engine's questions, typed ---------------------------------------------------------------------
    async def stats(self) -> EngineStats:
        return await self._call(lambda engine: engine.get_stats())

    async def cache_summary(self) -> tuple[CacheSummary, EngineStats]:
        """The cache's summary and the engine's stats, read at one moment."""
        return await self._call(lambda engine: (engine.cache_summary(), engine.get_stats()))

    async def cached_prompt_tokens(self, prompt: Prompt, cache_salt: str | None) -> int:
        return await self._call(lambda engine: engine.cached_prompt_tokens(prompt, cache_salt))

    async def cached_prompt_tokens_of(self, prompts: Sequence[tuple[Prompt, str | None]]) -> list[int]:
        """cached_prompt_tokens of many (prompt, cache_salt) pairs in one trip to the engine thread."""
        return await self._call(lambda engine: [engine.cached_prompt_tokens(p, salt) for p, salt in prompts])

    async def release_retention(self, prompt: Prompt, cache_salt: str | None, keep_tokens: int) -> int:
        return await self._call(lambda engine: engine.release_retention(prompt, cache_salt, keep_tokens))

    async def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        return await self._call(lambda engine: engine.reset_prefix_cache(salt_filter))

    async def render_cache_tree(self, max_depth: int, max_children: int) -> str:
        return await self._call(lambda engine: engine.render_cache_tree(max_depth, max_children))

    async def submit(
        self,
        request_ids: list[str],
        prompts: Sequence[str | list[int] | dict],
        options: Sequence[RequestOptions],
        *,
        stream: bool,
    ) -> RequestGroup:
        """Add one engine request per prompt, with its options (server/request_options.py built them),
        atomically: if any is rejected (ValueError), none stays. stream: the group yields each step's delta; else
        only each request's final output."""
        if not len(request_ids) == len(prompts) == len(options):
            raise ValueError(f"{len(request_ids)} ids, {len(prompts)} prompts and {len(options)} options")
        loop = asyncio.get_running_loop()
        group = RequestGroup(self, list(request_ids), self.max_backlog)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY

        def add(engine: EngineClient) -> None:
            added: list[str] = []
            try:
                for index, (rid, prompt, mine) in enumerate(zip(request_ids, prompts, options)):
                    engine.add_request(rid, prompt, mine, output_kind=kind)
                    added.append(rid)
                    self._sinks[rid] = _Sink(loop, group, index)
            except BaseException:
                for rid in added:
                    self._sinks.pop(rid, None)
                    self._safe_abort(rid)
                raise

        await self._call(add)
        self._groups.add(group)
        return group

    def cut_all(self, exc: BaseException) -> int:
        """End every group still running with exc and abort its engine requests (shutdown). Returns how many."""
        cut = 0
        for group in list(self._groups):
            if group.unfinished:
                group.fail(exc, abort=True)
                cut += 1
        return cut

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Fire and forget (safe from `finally` blocks and cancelled tasks)."""
        if self.is_alive:
            self._commands.put((lambda engine: self._abort(request_ids), None))

    # -- the engine thread ---------------------------------------------------------------------------------
    def _abort(self, request_ids: list[str]) -> None:
        aborted = 0
        for rid in request_ids:
            if self._sinks.pop(rid, None) is not None:  # still running: the engine holds its pages
                self._safe_abort(rid)
                aborted += 1
        if aborted and self.on_aborted is not None:
            self.on_aborted(aborted)

    def _safe_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:  # already finished inside the engine: nothing to free
            logger.debug("abort of %s ignored", rid, exc_info=True)

    def _run_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Run queued commands; block for the first one when idle (at most `timeout` seconds, when given). False
        once asked to stop."""
        while True:
            try:
                item = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            fn, future = item
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if future is not None:
                    future.set_exception(exc)
                else:
                    logger.exception("engine command failed")
            else:
                if future is not None:
                    future.set_result(result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestGroup, int, RequestOutput]]] = defaultdict(list)
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:  # aborted by us earlier: the engine reports it once more, nobody listens
                continue
            sink.count(output)
            if output.finished:
                self._sinks.pop(output.request_id, None)
                if self.on_finished is not None:
                    try:
                        self.on_finished(sink.finished(output))
                    except Exception:
                        logger.exception("on_finished hook failed")
            per_loop[sink.loop].append((sink.group, sink.index, output))
        for loop, items in per_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, exc: BaseException) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[RequestGroup]] = defaultdict(list)
        groups_seen: set[int] = set()
        for rid, sink in list(self._sinks.items()):
            self._safe_abort(rid)
            if id(sink.group) not in groups_seen:
                groups_seen.add(id(sink.group))
                per_loop[sink.loop].append(sink.group)
        self._sinks.clear()
        for loop, groups in per_loop.items():
            loop.call_soon_threadsafe(_fail_groups, groups, exc)

    def _run(self) -> None:
        failures = 0
        try:
            while True:
                # idle, the engine still has timers (a session's read-ahead before its pause ends): wake for them
                try:
                    wake = self.engine.run_timers()
                except Exception:  # a read-ahead is an optimization: never let it stop the loop
                    logger.exception("engine timers failed")
                    wake = None
                idle = not self.engine.has_unfinished_requests()
                if not self._run_commands(block=idle, timeout=None if wake is None else max(wake, 0.001)):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug in one step must not hang every client: fail them, go on
                    logger.exception("engine step failed")
                    self._fail_all(RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}"))
                    failures += 1
                    if failures >= 3:  # the engine is broken, not one request
                        raise
                    continue
                failures = 0
                self._dispatch(outputs)
        except BaseException as exc:
            logger.exception("engine loop died")
            self._dead = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))
        finally:
            if self._dead is None:
                self._dead = EngineDeadError("engine stopped")
            # answer commands that raced with the stop
            while True:
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item[1] is not None and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(EngineDeadError("engine stopped"))


def _deliver(items: list[tuple[RequestGroup, int, RequestOutput]]) -> None:
    for group, index, output in items:
        group.put(index, output)


def _fail_groups(groups: list[RequestGroup], exc: BaseException) -> None:
    for group in groups:
        group.fail(exc, abort=False)  # the engine already dropped their requests
