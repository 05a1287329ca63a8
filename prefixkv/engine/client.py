"""What a front end may ask of an engine: the EngineClient protocol and the tokenizer it reaches through it.

The HTTP server (through AsyncEngine, on the engine's own thread), the Ray replica's server and the CLI hold an
EngineClient: add and abort requests, step, the stats, the cache's summary, prewarm's probe of what is cached,
resets and the radix tree as text, each with a typed answer. Engine (engine.py) implements it; nothing outside
the engine package needs the Engine class or reaches past this protocol into the engine's parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from prefixkv.config import EngineConfig
from prefixkv.engine.metrics import EngineStats
from prefixkv.kvcache.summary import CacheSummary
from prefixkv.outputs import RequestOutput, RequestOutputKind
from prefixkv.request_options import RequestOptions
from prefixkv.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # text, token ids, or {"prompt" | "prompt_token_ids", "cache_salt", ...}


class EngineTokenizer(Protocol):
    """What the engine and the server need of the model's tokenizer (prefixkv.model.tokenizer.Tokenizer)."""

    eos_token_ids: set[int]

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def token_strings(self, ids: Iterable[int]) -> list[str]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, allow_special_tokens_in_content: bool = False
    ) -> list[int]: ...

    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (the server bounds prompt text by it)."""
        ...


class ModelShape(Protocol):
    """The two facts about the model the engine checks requests against."""

    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class TierDirectory:
    """The directory of the disk KV tier an engine stores KV in, and that KV's manifest (model digest, dtype, chunk
    size, kernels, ...: kvcache/offload/tier.py). What a front end keeps there outlives the process with the KV,
    and is only read back by a server whose manifest matches (the server's cache entries: server/cache_store_file.py).
    """

    path: str
    manifest: dict[str, Any]


class EngineClient(Protocol):
    config: EngineConfig
    model_name: str
    max_model_len: int
    tokenizer: EngineTokenizer
    kernels: dict[str, str]  # the hardware and kernel paths the model runs on (ModelRunner.kernel_report)
    # None: no tier, a host-RAM tier, or a directory ignored as another model's (kv_offload_on_mismatch=ignore)
    tier_directory: TierDirectory | None

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        options: RequestOptions | SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE,
    ) -> str:
        """Queue a request with the options its door built (ValueError, nothing queued, when it is bad); its id."""
        ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def run_timers(self) -> float | None:
        """Run what is due without a step (a session's read-ahead); seconds until the next, None if none."""
        ...

    def get_stats(self) -> EngineStats: ...

    def cache_summary(self) -> CacheSummary: ...

    def cached_prompt_tokens(self, prompt: Prompt, cache_salt: str | None = None) -> int:
        """Tokens of `prompt` a request starting with it would find cached now; no side effects."""
        ...

    def release_retention(self, prompt: Prompt, cache_salt: str | None = None, keep_tokens: int = 0) -> int:
        """End now the retention of `prompt`'s cached pages past its first keep_tokens tokens; pages released."""
        ...

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool: ...

    def render_cache_tree(self, max_depth: int = 3, max_children: int = 5) -> str: ...

    def close(self) -> None: ...
