"""The engine: requests in, one step of the engine core per step(), outputs out.

Synchronous and single-threaded on purpose: LLM.generate drives it in a loop, the HTTP server from its own
thread. n > 1 is fanned out into n sibling requests (they share the prompt's pages through the prefix cache) and
merged back into one RequestOutput.

What a step computes is the engine core's (engine/core.py: schedule, execute, update, shared with the simulator);
the engine adds what a sampled token means to a client: text, stop rules, logprobs and outputs. It is handed its
model runner, tokenizer, KV manager and step components (a second KV tier, KV events) by the composition root
(prefixkv.llm.build_engine), so this package imports no model, tier or event class, and loads neither torch nor
the model package.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from prefixkv.batch import BatchItem, Sample
from prefixkv.config import EngineConfig
from prefixkv.engine.client import EngineTokenizer, ModelShape
from prefixkv.engine.core import EngineCore, StepComponent
from prefixkv.engine.detokenizer import IncrementalDetokenizer
from prefixkv.engine.metrics import EngineStats
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.scheduler import Scheduler, SchedulerOutput
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.kvcache.retention import validate_retention
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from prefixkv.request import MultiModalHash, Request, RequestStatus
from prefixkv.sampling_params import SamplingParams


class ModelExecutor(Protocol):
    """What the engine needs of a model runner: one forward pass (and sampling) over a batch, on a KV pool of
    num_pages pages of page_size token slots."""

    num_pages: int
    page_size: int

    def execute(self, items: list[BatchItem]) -> Sequence[Sample | None]: ...


class RunnerExecutor:
    """The engine core's Executor over a model runner: each scheduled chunk as a BatchItem with its page table;
    the runner's time is counted (what an engine does besides is its overhead, which prefix caching adds to)."""

    def __init__(self, runner: ModelExecutor, kv: KVCacheManager) -> None:
        self.runner, self.kv = runner, kv
        self.seconds = 0.0

    def execute(self, scheduled: SchedulerOutput) -> Sequence[Sample | None]:
        if not scheduled.scheduled:
            return []
        items = []
        for req, n in scheduled.scheduled:
            start = req.num_computed_tokens
            items.append(
                BatchItem(
                    req.request_id,
                    req.token_ids[start : start + n],
                    start,
                    self.kv.page_table(req),
                    start + n == req.num_tokens and not req.prefill_only,
                    req.sampling_params,
                    req.num_output_tokens,
                )
            )
        started = time.perf_counter()
        samples = self.runner.execute(items)
        self.seconds += time.perf_counter() - started
        return samples


@dataclass(eq=False, slots=True)
class _Sequence:
    """Engine-side state of one generated sequence: the scheduled Request plus its text."""

    request: Request
    parent_id: str
    index: int
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Sample] | None = None
    cumulative_logprob: float = 0.0
    # what earlier outputs carried (output_kind="delta" sends only what came after)
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finished: bool = False


@dataclass(eq=False, slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


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
    ) -> None:
        """runner: a model runner over a pool of runner.num_pages pages of config.page_size tokens, and kv the KV
        manager over the same pool (prefixkv.kvcache.factory; a TieredKVCache with a second tier); components: what
        else takes part in every step (engine/core.py: a tier's copier, the KV event relay), which the engine
        closes in close(). tokenizer and model_config: the model's. kernels: labels of the hardware and kernel
        paths the runner computes with (ModelRunner.kernel_report), passed through to /metrics and benchmarks."""
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
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        self.kv = kv
        self.policy = create_policy(config)
        self.scheduler = Scheduler(config, self.kv, self.policy)
        self._executor = RunnerExecutor(runner, kv)
        self.core = EngineCore(self.scheduler, self._executor, components)
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, _Sequence] = {}  # by the scheduled request's id
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._computed_tokens = 0
        self._aborted_outputs: list[RequestOutput] = []

    @property
    def components(self) -> list[StepComponent]:
        return self.core.components

    # -- requests in -----------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: str | None = None,
        mm_hashes=None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE,
        retention_seconds: float | None = None,
        retention_priority: int = 0,
        prefill_only: bool = False,
        prompt_cache_key: str | None = None,
    ) -> str:
        """Validate and queue a request; raise ValueError (and queue nothing) when it is bad.

        retention_seconds / retention_priority: keep the pages this request computes or hits cached that long
        (kvcache/retention.py; bounded by retained_pool_fraction). prefill_only (prewarm): compute and cache the
        prompt's KV, sample nothing; the request finishes ("length", no tokens) once its prompt is computed.
        prompt_cache_key: the client's grouping hint (OpenAI's field), recorded on the Request.

        output_kind (vLLM's RequestOutputKind): "cumulative" outputs carry everything generated so far, "delta"
        outputs only what is new since the request's previous output (memory linear in the output length),
        "final_only" outputs come once, when the request finishes."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        kind = RequestOutputKind.parse(output_kind)
        params = sampling_params or SamplingParams()
        params.validate()
        text, token_ids, cache_salt, lora_id, mm = self._parse_prompt(prompt, cache_salt, lora_id, mm_hashes)
        max_tokens = self._check_lengths(token_ids, params)
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        retention_seconds = validate_retention(retention_seconds, retention_priority)
        if prompt_cache_key is not None and not isinstance(prompt_cache_key, str):
            raise ValueError(f"prompt_cache_key must be a string, got {prompt_cache_key!r}")
        if prefill_only and params.n != 1:
            raise ValueError("a prefill-only (prewarm) request computes one prompt: n must be 1")

        arrival = time.monotonic() if arrival_time is None else arrival_time
        sequences = []
        for i in range(params.n):
            child_params = (
                params if params.n == 1 else replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            )
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                rid,
                list(token_ids),
                child_params,
                arrival_time=arrival,
                prompt=text,
                priority=priority,
                cache_salt=cache_salt,
                lora_id=lora_id,
                mm_hashes=mm,
                max_tokens=max_tokens,
                retention_seconds=retention_seconds,
                retention_priority=retention_priority,
                prefill_only=prefill_only,
                prompt_cache_key=prompt_cache_key,
            )
            detok = IncrementalDetokenizer(
                self.tokenizer,
                child_params.stop or (),
                child_params.include_stop_str_in_output,
                child_params.skip_special_tokens,
            )
            seq = _Sequence(req, request_id, i, detok, logprobs=[] if params.logprobs is not None else None)
            sequences.append(seq)
        parent = _Parent(request_id, text, list(token_ids), sequences, arrival, kind)
        self._parents[request_id] = parent
        for seq in sequences:
            self._seqs[seq.request.request_id] = seq
            self.core.add(seq.request)
        self._prompt_tokens += len(token_ids) * params.n
        return request_id

    def _parse_prompt(self, prompt, cache_salt, lora_id, mm_hashes):
        text = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {
                "prompt",
                "prompt_token_ids",
                "cache_salt",
                "lora_id",
                "adapter_id",
                "multi_modal_hashes",
            }
            if unknown:
                raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
            cache_salt = prompt.get("cache_salt", cache_salt)
            lora_id = prompt.get("lora_id", prompt.get("adapter_id", lora_id))
            mm_hashes = prompt.get("multi_modal_hashes", mm_hashes)
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                token_ids = None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            token_ids = prompt
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            token_ids = self.tokenizer.encode(text)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        mm = tuple(m if isinstance(m, MultiModalHash) else MultiModalHash(*m) for m in (mm_hashes or ()))
        return text, list(token_ids), cache_salt, (None if lora_id is None else str(lora_id)), mm

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context length (max_model_len) is "
                f"{self.max_model_len}; at least one token must be left to generate"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} with a {n}-token prompt exceeds max_model_len="
                f"{self.max_model_len}; ask for at most {self.max_model_len - n} tokens"
            )
        capacity = self.kv.num_pages * self.kv.page_size
        if n + max_tokens > capacity:
            raise ValueError(
                f"prompt plus max_tokens ({n + max_tokens} tokens) cannot fit the KV cache ({capacity} tokens)"
            )
        return max_tokens

    def abort(self, request_id: str) -> None:
        parent = self._parents.get(str(request_id))
        if parent is None:
            return
        for seq in parent.sequences:
            if seq.finish_reason is None:
                self._finish(seq, RequestStatus.FINISHED_ABORTED)
        self._aborted_outputs.append(self._output(parent))
        self._parents.pop(parent.request_id, None)

    # -- the loop -------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._parents or self._aborted_outputs)  # aborted outputs are reported by the next step()

    def step(self) -> list[RequestOutput]:
        """One step of the engine core, then what its samples mean: tokens, text, stop rules, outputs (of the
        requests this step touched, and of those aborted since the last step)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        result = self.core.step()
        self._computed_tokens += result.scheduled.num_batched_tokens
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
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
                outputs.append(self._output(parent))
            if finished:
                del self._parents[parent.request_id]
        return outputs

    def close(self) -> None:
        """Close the step components (a tier's last writes, the KV event publisher); a later engine on the same
        tier directory, or the same host tier, finds what this one stored."""
        self.core.close()

    def flush(self) -> None:
        """Wait until the components' background work handed off so far is done (every chunk saved so far is in
        the tier)."""
        self.core.flush()

    def _on_token(self, seq: _Sequence, sample: Sample, now: float) -> None:
        """The scheduler has appended the sampled token: record its logprobs and text, and apply stop rules."""
        req = seq.request
        token = sample.token_id
        self._generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(sample)
            seq.cumulative_logprob += sample.logprob or 0.0
        params = req.sampling_params
        stop_str = seq.detok.add(token)
        if stop_str is not None:
            seq.stop_reason = stop_str
            self._finish(seq, RequestStatus.FINISHED_STOPPED)
        elif not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.stop_reason = None
            self._finish(seq, RequestStatus.FINISHED_STOPPED)
        elif token in (params.stop_token_ids or ()):
            seq.stop_reason = token
            self._finish(seq, RequestStatus.FINISHED_STOPPED)
        elif req.num_output_tokens >= req.max_tokens:
            self._finish(seq, RequestStatus.FINISHED_LENGTH)

    def _finish(self, seq: _Sequence, status: RequestStatus) -> None:
        self.scheduler.finish(seq.request, status)
        seq.finish_reason = status.value
        seq.request.finish_time = time.monotonic()
        self._seqs.pop(seq.request.request_id, None)

    def _output(self, parent: _Parent) -> RequestOutput:
        delta = parent.output_kind is RequestOutputKind.DELTA
        completions = []
        for seq in parent.sequences:
            req = seq.request
            tokens = req.output_token_ids
            if not delta:
                completions.append(
                    CompletionOutput(
                        index=seq.index,
                        text=seq.detok.text,
                        token_ids=tokens,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                        logprobs=None if seq.logprobs is None else list(seq.logprobs),
                        cumulative_logprob=None if seq.logprobs is None else seq.cumulative_logprob,
                    )
                )
                continue
            finished_now = seq.finish_reason is not None and not seq.sent_finished
            if len(tokens) == seq.sent_tokens and not finished_now:
                continue  # nothing new for this sibling
            text = seq.detok.text
            shown = len(text) if seq.finish_reason is not None else max(seq.sent_text, len(text) - seq.detok.holdback)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text[seq.sent_text : shown],
                    token_ids=tokens[seq.sent_tokens :],
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=None if seq.logprobs is None else seq.logprobs[seq.sent_tokens :],
                    cumulative_logprob=None if seq.logprobs is None else seq.cumulative_logprob,
                )
            )
            seq.sent_tokens, seq.sent_text = len(tokens), shown
            seq.sent_finished = seq.finish_reason is not None
        reqs = [s.request for s in parent.sequences]
        first = reqs[0]
        finished = all(seq.finish_reason is not None for seq in parent.sequences)
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=min((r.first_scheduled_time for r in reqs if r.first_scheduled_time), default=None),
            first_token_time=min((r.first_token_time for r in reqs if r.first_token_time), default=None),
            finish_time=max((r.finish_time or 0 for r in reqs), default=None) if finished else None,
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=metrics,
        )

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
            computed_tokens_total=self._computed_tokens,
            model_seconds_total=self._executor.seconds,
            prefix_cache_readmission_queries=kv.stats.readmission_queries,
            prefix_cache_readmission_hits=kv.stats.readmission_hits,
            num_cached_pages=kv.num_cached_pages(),
            **self.core.stats(),
        )

    def cached_prompt_tokens(self, prompt: str | list[int] | dict, cache_salt: str | None = None) -> int:
        """Tokens of `prompt` a request starting with it would find cached now (whole pages; the prompt's last
        token included, as for a longer request). No side effects."""
        _, token_ids, cache_salt, lora_id, mm = self._parse_prompt(prompt, cache_salt, None, None)
        probe = Request(
            f"cache-probe-{next(self._ids)}",
            [*token_ids, 0],  # one more token: a lookup never covers a request's own last token
            SamplingParams(max_tokens=1),
            cache_salt=cache_salt,
            lora_id=lora_id,
            mm_hashes=mm,
        )
        try:
            return min(self.kv.lookup(probe), len(token_ids))
        finally:
            self.kv.free(probe)  # forgets the lookup's memo; the probe holds no pages

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
