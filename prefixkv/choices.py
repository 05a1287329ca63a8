"""Every closed list of choices the engine takes, defined once: a Literal type for the checker and the tuple of
its values for everything else (config validation, command-line choices, the caches, the benchmarks).

`check(option, value, choices)` is the one way an option is validated against its list, so the error message is
the same wherever the value enters (a config, a direct cache constructor, a benchmark flag).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

PrefixCache = Literal["hash", "radix", "off"]
SchedulePolicy = Literal["fcfs", "priority", "lpm", "dfs-weight", "bounded-lpm", "k-lpm"]
HashAlgo = Literal["sha256", "xxhash"]
Eviction = Literal["lru", "lfu", "cost"]  # prefixkv/kvcache/eviction.py
Dtype = Literal["float32", "bfloat16", "float16"]
KVEventsFormat = Literal["vllm", "array"]  # prefixkv/kv_events/wire.py's layouts
KVOffloadWritePolicy = Literal["write_through", "write_back"]  # prefixkv/kvcache/offload/tiered_cache.py
KVOffloadOnMismatch = Literal["refuse", "ignore"]
WeightFormat = Literal["dense", "gguf", "q8_0"]  # prefixkv/model/quantized.py
# prefixkv/engine/agent_sessions.py; +prefetch: also read each turn back from the second tier before its pause ends
SessionPinPolicy = Literal[
    "none", "ttl", "pause", "session", "none+prefetch", "ttl+prefetch", "pause+prefetch", "session+prefetch"
]

PREFIX_CACHES: tuple[str, ...] = get_args(PrefixCache)
SCHEDULE_POLICIES: tuple[str, ...] = get_args(SchedulePolicy)
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
EVICTIONS: tuple[str, ...] = get_args(Eviction)
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_EVENTS_FORMATS: tuple[str, ...] = get_args(KVEventsFormat)
KV_OFFLOAD_WRITE_POLICIES: tuple[str, ...] = get_args(KVOffloadWritePolicy)
KV_OFFLOAD_ON_MISMATCH: tuple[str, ...] = get_args(KVOffloadOnMismatch)
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
SESSION_PIN_POLICIES: tuple[str, ...] = get_args(SessionPinPolicy)


def check(option: str, value: Any, choices: tuple[str, ...]) -> None:
    """ValueError naming the option and its choices when value is not one of them."""
    if value not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}; got {value!r}")
