"""What a router knows about one request: the prompt as the engine will see it, and the keys of its cache.

Routing uses the rendered prompt (after the chat template), never the first message alone: a multi-turn chat
shares its whole history with its previous turn, and a system prompt alone would send every conversation of a
tenant to one replica. The adapter id and the tenant's cache salt are part of every block key, exactly as the
engine's caches key them, so two tenants with the same prompt never look like one prefix to the router either.
The hashes are the ones the caches' KV events carry (hashing.prompt_block_hashes), for either prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixkv.kvcache.hashing import prompt_block_hashes


@dataclass
class RouteRequest:
    """One request to route. `session_key` (a `prompt_cache_key` or session header) pins a conversation."""

    token_ids: Sequence[int]
    lora_id: str | None = None
    cache_salt: str | None = None
    session_key: str | None = None
    request_id: str = ""
    # the replica this request must go to while it is alive (it holds state the request names: a /v1/caches
    # entry); it outranks the session pin and the policy. Gone: routed as if unset, and that replica's state with it
    target_replica: str | None = None
    # set by Router.route: the longest prompt prefix (tokens) another live replica holds, as the policy's index
    # believes; the replica names its misses of it `routed` (cache_miss.py). 0: none, or the policy keeps no index
    held_elsewhere_tokens: int = 0
    # set by the Ray Serve adapter when it routes the request: the live replicas it chose among, which the caller
    # (the ingress, in the same process) reads back to address each replica (a listing fanned out to all)
    live_replicas: tuple[str, ...] = ()
    _hashes: dict[tuple[int, str], list[int]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_hashes(self, block_size: int, algo: str = "sha256") -> list[int]:
        """The prompt's block hashes at this block size (computed once per size: several policies may ask)."""
        key = (block_size, algo)
        hashes = self._hashes.get(key)
        if hashes is None:
            hashes = self._hashes[key] = prompt_block_hashes(
                self.token_ids, block_size, algo, self.lora_id, self.cache_salt
            )
        return hashes
