"""The engine: requests in, one step of the engine core per step(), outputs out.

Synchronous and single-threaded on purpose: LLM.generate drives it in a loop, the HTTP server from its own
thread. n > 1 is fanned out into n sibling requests (they share the prompt's pages through the prefix cache) and
merged back into one RequestOutput.

What a step computes is the engine core's (engine/core.py: schedule, execute, update, shared with the simulator);
the engine adds what a sampled token means to a client: text, stop rules, logprobs and outputs. It is handed its
model runner, tokenizer, KV manager and step components (a second KV tier, KV events) by the composition root
(prefixkv.llm.build_engine), so this package imports no model, tier or event class, and loads neither torch nor
the model package. A prompt is parsed and checked in prompts.py; what is kept of a request between steps, and the
outputs made of it, in sequences.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Protocol

from prefixkv.batch import BatchItem, Sample
from prefixkv.config import EngineConfig
from prefixkv.engine.agent_sessions import SessionPins
from prefixkv.engine.client import EngineTokenizer, ModelShape, Prompt, TierDirectory
from prefixkv.engine.constraints import ConstrainedOutput, Grammars, GrammarStep
from prefixkv.engine.core import EngineCore, StepComponent
from prefixkv.engine.detokenizer import IncrementalDetokenizer
from prefixkv.engine.metrics import EngineStats
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.prompts import max_tokens_for, parse_prompt
from prefixkv.engine.scheduler import Scheduler, SchedulerOutput
from prefixkv.engine.sequences import ParentRequest, SequenceState, build_output
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.outputs import RequestOutput, RequestOutputKind
from prefixkv.request import Request, RequestStatus
from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ModelExecutor(Protocol):
    """What the engine needs of a model runner: one forward pass (and sampling) over a batch, on a KV pool of
    num_pages pages of page_size token slots."""

    num_pages: int
    page_size: int

    def execute(self, items: list[BatchItem]) -> Sequence[Sample | None]: ...


class RunnerExecutor:
    """The engine core's Executor over a model runner: each scheduled chunk as a BatchItem with its page table;
    the runner's time is counted (what an engine does besides is its overhead, which prefix caching adds to)."""

    def __init__(
        self, runner: ModelExecutor, kv: KVCacheManager, constraint: Callable[[Request], ConstrainedOutput | None]
    ) -> None:
        """constraint: the grammar's matcher of a request (None: unconstrained). Its mask for the next token is
        computed on a worker thread while the forward runs; a greedy row is sampled first and the mask applied
        only when the grammar refuses its token (GrammarStep)."""
        self.runner, self.kv, self.constraint = runner, kv, constraint
        self.seconds = 0.0
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="prefixkv-mask")

    def _grammar(self, req: Request) -> GrammarStep | None:
        constraint = self.constraint(req)
        if constraint is None:
            return None
        params = req.sampling_params
        return GrammarStep(constraint, params.greedy and params.logprobs is None, self._masks)

    def execute(self, scheduled: SchedulerOutput) -> Sequence[Sample | None]:
        if not scheduled.scheduled:
            return []
        items, grammars = [], []
        for req, n in scheduled.scheduled:
            start = req.num_computed_tokens
            sample = start + n == req.num_tokens and not req.prefill_only
            grammar = self._grammar(req) if sample else None
            if grammar is not None:
                grammars.append(grammar)
            items.append(
                BatchItem(
                    req.request_id,
                    req.token_ids[start : start + n],
                    start,
                    self.kv.page_table(req),
                    sample,
                    req.sampling_params,
                    req.num_output_tokens,
                    grammar,
                    *_history(req, sample),
                )
            )
        started = time.perf_counter()
        try:
            samples = self.runner.execute(items)
        finally:  # no mask outlives its step: the matcher takes the sampled token next, on this thread
            wait([g.pending for g in grammars])
        self.seconds += time.perf_counter() - started
        return samples


def _history(req: Request, sample: bool) -> tuple[list[int] | None, int]:
    """What a penalized request's sampler reads: its tokens so far and how many are the prompt's."""
    if not sample or not req.sampling_params.penalized:
        return None, 0
    return list(req.token_ids), req.num_prompt_tokens


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelExecutor,
        tokenizer: EngineTokenizer,
        model_config: ModelShape,
        kv: KVCacheManager,
        components: Sequence[StepComponent] = (),
        model_name: str = "",
        kernels: dict[str, str] | None = None,
        tier_directory: TierDirectory | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """runner: a model runner over a pool of runner.num_pages pages of config.page_size tokens, and kv the KV
        manager over the same pool (prefixkv.kvcache.factory; a TieredKVCache with a second tier); components: what
        else takes part in every step (engine/core.py: a tier's copier, the KV event relay), which the engine
        closes in close(). tokenizer and model_config: the model's. kernels: labels of the hardware and kernel
        paths the runner computes with (ModelRunner.kernel_report), passed through to /metrics and benchmarks.
        tier_directory: the disk tier's directory and manifest when one is in use (client.TierDirectory).
        grammars: the grammar engine that constrains structured outputs (engine/constraints.py; None: requests
        with structured_outputs are refused)."""
        if runner.page_size != config.page_size:
            raise ValueError(f"the runner's page size {runner.page_size} differs from page_size={config.page_size}")
        if (kv.num_pages, kv.page_size) != (runner.num_pages, runner.page_size):
            raise ValueError(
                f"the KV manager's pool ({kv.num_pages} pages of {kv.page_size}) is not the runner's "
                f"({runner.num_pages} pages of {runner.page_size})"
            )
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = model_name
        self.kernels = dict(kernels or {})
        self.tier_directory = tier_directory
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        self.kv = kv
        self.policy = create_policy(config)
        self.scheduler = Scheduler(config, self.kv, self.policy)
        # what session hints pin between turns (and, with a write_back tier, hand to the tier when a turn ends;
        # with +prefetch, read back from it before the session is due)
        demote = config.kv_offload and config.kv_offload_write_policy == "write_back"
        self.sessions = SessionPins(self.kv, config.session_policy, demote=demote)
        self.grammars = grammars
        self._executor = RunnerExecutor(runner, kv, self._constraint)
        self.core = EngineCore(self.scheduler, self._executor, components)
        self._parents: dict[str, ParentRequest] = {}
        self._seqs: dict[str, SequenceState] = {}  # by the scheduled request's id
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._computed_tokens = 0
        self._jump_forward_tokens = 0  # output tokens the grammar forced, appended without sampling
        self._pending_outputs: list[RequestOutput] = []

    @property
    def components(self) -> list[StepComponent]:
        return self.core.components

    # -- requests in -----------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        options: RequestOptions | SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE,
    ) -> str:
        """Validate and queue a request; raise ValueError (and queue nothing) when it is bad.

        options: what its door built (request_options.py: sampling, priority, namespace, retention, session,
        prewarm); a bare SamplingParams stands for RequestOptions(sampling), None for the defaults. A prompt
        dict's cache_salt / lora_id name the request's namespace (they win over the options', as a vLLM prompt's
        cache_salt does). With n > 1, the n completions are n sibling requests, each with its own seed (seed + i)
        when one is set; the first completion's sequence is the session's turn.

        output_kind (vLLM's RequestOutputKind): "cumulative" outputs carry everything generated so far, "delta"
        outputs only what is new since the request's previous output (memory linear in the output length),
        "final_only" outputs come once, when the request finishes."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        kind = RequestOutputKind.parse(output_kind)
        if options is None or isinstance(options, SamplingParams):
            options = RequestOptions(options or SamplingParams())
        elif not isinstance(options, RequestOptions):
            raise ValueError(f"options must be RequestOptions or SamplingParams, got {type(options).__name__}")
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, options.cache_salt, options.lora_id)
        if (parsed.cache_salt, parsed.lora_id) != (options.cache_salt, options.lora_id):
            options = replace(options, cache_salt=parsed.cache_salt, lora_id=parsed.lora_id)
        params = options.sampling
        params.check_vocab(self.model_config.vocab_size)
        token_ids = parsed.token_ids
        max_tokens = max_tokens_for(len(token_ids), params, self.max_model_len, self.kv.num_pages * self.kv.page_size)

        arrival = time.monotonic() if arrival_time is None else arrival_time
        sequences = []
        for i in range(params.n):
            mine = options
            if params.n > 1:
                child = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                mine = replace(options, sampling=child, session=options.session if i == 0 else None)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                rid, list(token_ids), mine, arrival_time=arrival, prompt=parsed.text, mm_hashes=parsed.mm_hashes
            )
            req.max_tokens = max_tokens
            child_params = mine.sampling
            detok = IncrementalDetokenizer(
                self.tokenizer,
                child_params.stop or (),
                child_params.include_stop_str_in_output,
                child_params.skip_special_tokens,
            )
            seq = SequenceState(req, request_id, i, detok, logprobs=[] if params.logprobs is not None else None)
            if params.structured_outputs is not None:  # compiled before anything is queued: a bad one adds nothing
                if self.grammars is None:
                    raise ValueError("structured_outputs: this engine has no grammar engine")
                seq.constraint = self.grammars.start(params.structured_outputs)
            sequences.append(seq)
        parent = ParentRequest(request_id, parsed.text, list(token_ids), sequences, arrival, kind)
        self._parents[request_id] = parent
        self.sessions.on_add(sequences[0].request)
        for seq in sequences:
            self._seqs[seq.request.request_id] = seq
            if not self._jump_forward(seq):  # what the grammar forces first is computed with the prompt
                self.core.add(seq.request)
        if all(seq.finish_reason is not None for seq in sequences):  # forced to its end: reported by the next step
            self._pending_outputs.append(build_output(parent))
            del self._parents[request_id]
        self._prompt_tokens += len(token_ids) * params.n
        return request_id

    def abort(self, request_id: str) -> None:
        parent = self._parents.get(str(request_id))
        if parent is None:
            return
        for seq in parent.sequences:
            if seq.finish_reason is None:
                self._finish(seq, RequestStatus.FINISHED_ABORTED)
        self._pending_outputs.append(build_output(parent))
        self._parents.pop(parent.request_id, None)

    # -- the loop -------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._parents or self._pending_outputs)  # aborted or forced to the end: next step() reports

    def step(self) -> list[RequestOutput]:
        """One step of the engine core, then what its samples mean: tokens, text, stop rules, outputs (of the
        requests this step touched, and of those aborted since the last step)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self.sessions.run_timers()  # read-aheads due before this step's schedule looks the requests up
        result = self.core.step()
        self._computed_tokens += result.scheduled.num_batched_tokens
        now = time.monotonic()
        touched: dict[str, ParentRequest] = {}
        for (req, _), sample in zip(result.scheduled.scheduled, result.samples):
            if sample is None:
                if req.prefill_only and req.num_computed_tokens == req.num_tokens:  # prewarmed: its KV is cached
                    seq = self._seqs[req.request_id]
                    self._finish(seq, RequestStatus.FINISHED_LENGTH)
                    touched[seq.parent_id] = self._parents[seq.parent_id]
                continue
            seq = self._seqs[req.request_id]
            self._on_token(seq, sample, now)
            touched[seq.parent_id] = self._parents[seq.parent_id]
        for parent in touched.values():
            finished = all(seq.finish_reason is not None for seq in parent.sequences)
            if finished or parent.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(build_output(parent))
            if finished:
                del self._parents[parent.request_id]
        self.core.after_outputs()
        return outputs

    def run_timers(self) -> float | None:
        """Run what is due now without a request to step (an agent session's read-ahead from the tier before its
        announced pause ends, session_policy +prefetch); the seconds until the next is due, None when nothing is
        pending. step() runs them too; an idle caller calls this again after that long."""
        return self.sessions.run_timers()

    def close(self) -> None:
        """Close the step components (a tier's last writes, the KV event publisher); a later engine on the same
        tier directory, or the same host tier, finds what this one stored."""
        self.core.close()

    def flush(self) -> None:
        """Wait until the components' background work handed off so far is done (every chunk saved so far is in
        the tier)."""
        self.core.flush()

    def _on_token(self, seq: SequenceState, sample: Sample, now: float) -> None:
        """The scheduler has appended the sampled token: record its logprobs and text, apply stop rules, then
        jump forward over what the grammar forces after it."""
        req = seq.request
        self._generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(sample)
            seq.cumulative_logprob += sample.logprob or 0.0
        if not self._take(seq, sample.token_id):
            self._jump_forward(seq)

    def _jump_forward(self, seq: SequenceState) -> bool:
        """With jump_forward on, append the tokens the grammar forces now (they are computed as one chunk in
        the next step, which samples after them); True when one of them ended the request. Not for a request
        that asks logprobs: a forced token has no sampled distribution to report."""
        req = seq.request
        if not self.config.jump_forward or seq.constraint is None or seq.logprobs is not None:
            return False
        for token in seq.constraint.forced()[: req.max_tokens - req.num_output_tokens]:
            req.token_ids.append(token)
            self._generation_tokens += 1
            self._jump_forward_tokens += 1
            if self._take(seq, token):
                return True
        return False

    def _take(self, seq: SequenceState, token: int) -> bool:
        """One output token (already in the request's tokens): its text, the grammar, the stop rules; True when
        it ended the request."""
        req = seq.request
        params = req.sampling_params
        stop_str = seq.detok.add(token)
        constraint = seq.constraint
        if constraint is not None:
            constraint.accept(token)
        if stop_str is not None:
            seq.stop_reason = stop_str
        elif not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.stop_reason = None
        elif token in (params.stop_token_ids or ()):
            seq.stop_reason = token
        elif constraint is not None and (constraint.finished or constraint.error is not None):
            # the grammar is complete (or its matcher failed): nothing more may follow
            if constraint.error is not None:
                logger.warning("request %s: structured output matcher failed: %s", req.request_id, constraint.error)
            seq.stop_reason = None
        elif req.num_output_tokens >= req.max_tokens:
            self._finish(seq, RequestStatus.FINISHED_LENGTH)
            return True
        else:
            return False
        self._finish(seq, RequestStatus.FINISHED_STOPPED)
        return True

    def _constraint(self, request: Request) -> ConstrainedOutput | None:
        seq = self._seqs.get(request.request_id)
        return seq.constraint if seq is not None else None

    def _finish(self, seq: SequenceState, status: RequestStatus) -> None:
        self.scheduler.finish(seq.request, status)
        self.sessions.on_finish(seq.request, aborted=status is RequestStatus.FINISHED_ABORTED)
        seq.finish_reason = status.value
        seq.request.finish_time = time.monotonic()
        self._seqs.pop(seq.request.request_id, None)

    # -- introspection ---------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_pages_total=kv.num_pages,
            num_pages_used=kv.num_used_pages(),
            kv_usage=kv.usage(),
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefix_cache_hit_rate=kv.stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.scheduler.step_count,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            jump_forward_tokens_total=self._jump_forward_tokens,
            computed_tokens_total=self._computed_tokens,
            model_seconds_total=self._executor.seconds,
            prefix_cache_readmission_queries=kv.stats.readmission_queries,
            prefix_cache_readmission_hits=kv.stats.readmission_hits,
            num_cached_pages=kv.num_cached_pages(),
            prefix_cache_missed_by_cause=dict(kv.stats.missed_by_cause),
            **self.core.stats(),
        )

    def cached_prompt_tokens(self, prompt: Prompt, cache_salt: str | None = None) -> int:
        """Tokens of `prompt` a request starting with it would find cached now (whole pages; the prompt's last
        token included, as for a longer request). No side effects."""
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, cache_salt)
        probe = Request(
            f"cache-probe-{next(self._ids)}",
            [*parsed.token_ids, 0],  # one more token: a lookup never covers a request's own last token
            RequestOptions(SamplingParams(max_tokens=1), cache_salt=parsed.cache_salt, lora_id=parsed.lora_id),
            mm_hashes=parsed.mm_hashes,
        )
        try:
            return min(self.kv.lookup(probe), len(parsed.token_ids))
        finally:
            self.kv.free(probe)  # forgets the lookup's memo; the probe holds no pages

    def release_retention(self, prompt: Prompt, cache_salt: str | None = None, keep_tokens: int = 0) -> int:
        """End now the retention of `prompt`'s cached pages past its first `keep_tokens` tokens (a retained
        prefix let go early: a server cache entry deleted or shortened); they stay cached as ordinary pages.
        Returns how many pages were released. Nothing else changes."""
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, cache_salt)
        probe = Request(
            f"cache-probe-{next(self._ids)}",
            [*parsed.token_ids, 0],  # as cached_prompt_tokens: the prompt's own last token's page counts too
            RequestOptions(SamplingParams(max_tokens=1), cache_salt=parsed.cache_salt, lora_id=parsed.lora_id),
            mm_hashes=parsed.mm_hashes,
        )
        try:
            return self.kv.release_retention(probe, keep_tokens)
        finally:
            self.kv.free(probe)

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Drop cached KV no request holds; salt_filter limits it to the namespaces (tenants) it accepts."""
        done = self.kv.reset_prefix_cache(salt_filter)
        self.core.reset()
        return done

    def cache_summary(self) -> CacheSummary:
        return self.kv.summary()

    def render_cache_tree(self, max_depth: int = 3, max_children: int = 5) -> str:
        """The top of the radix tree as text (ValueError for caches that are not a tree)."""
        return self.kv.render_tree(
            tokenizer_decode=self.tokenizer.decode, max_depth=max_depth, max_children=max_children
        )
