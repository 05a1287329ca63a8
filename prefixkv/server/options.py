"""How the HTTP server serves an engine: everything `prefixkv serve` takes beyond the engine's own options, as one
frozen object that goes from the command line to every app, the single-process one or each Ray Serve replica's
(and the Ray ingress, whose tenant salts must be the replicas')."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixkv.server.limits import ServerLimits
from prefixkv.server.protocol import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST

# the APIs whose max_tokens --clamp-max-tokens may lower to what fits (each route passes its name to request_options)
CLAMP_APIS = ("chat", "completions", "responses", "messages", "gemini")
# Anthropic's clients ask for their own maximum whatever the model (Claude Code: 32000), and stop at a 400
DEFAULT_CLAMP_MAX_TOKENS = frozenset({"messages"})


@dataclass(frozen=True)
class ServingOptions:
    served_model_name: str | None = None  # the model name clients must send (default: the model's)
    api_key: str | None = None  # one admin key (no key and no key file: every caller is an admin)
    api_key_file: str | None = None  # KEY TENANT [ROLE] lines (server/auth.py)
    tenant_isolation: str | None = None  # None: `api-key` when the key file gives tenants, else `none`
    max_n: int = DEFAULT_MAX_N  # completions per prompt
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    allow_special_tokens_in_content: bool = False  # chat content may contain control tokens (unsafe)
    clamp_max_tokens: frozenset[str] = DEFAULT_CLAMP_MAX_TOKENS  # APIs whose max_tokens is lowered to what fits
    limits: ServerLimits = field(default_factory=ServerLimits)  # connections, bodies, streams, shutdown

    def __post_init__(self) -> None:
        for option, value in (("max_n", self.max_n), ("max_prompts_per_request", self.max_prompts_per_request)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an integer >= 1, got {value!r}")
        unknown = sorted(set(self.clamp_max_tokens) - set(CLAMP_APIS))
        if unknown:
            raise ValueError(f"clamp_max_tokens: unknown API {unknown[0]!r} (one of {', '.join(CLAMP_APIS)})")
