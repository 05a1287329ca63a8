"""What every handler needs, hung on app.state.server: the engine loop, names, metrics and policies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from prefixkv.server.async_engine import AsyncEngine, RequestGroup
from prefixkv.server.auth import KeyRing, cache_salt_for
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    served_model_name: str
    max_model_len: int
    metrics: ServerMetrics
    keys: KeyRing | None = None  # None: no key configured, every caller is an admin
    tenant_isolation: str = "none"

    def check_model(self, model: str | None) -> str:
        """OpenAI answers an unknown model with 404; an omitted model means the one being served."""
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                           status=404, param="model", code="model_not_found")
        return self.served_model_name


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def submit(state: ServerState, raw: Request, request_id: str, prompts: list, params: Any,
                 body: Any) -> RequestGroup:
    """Add one engine request per prompt; engine rejections (too long, bad ids, ...) become 400s."""
    salt = cache_salt_for(state.tenant_isolation, raw, body.user, body.cache_salt)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        return await state.engine.submit(ids, prompts, params, priority=body.priority, cache_salt=salt)
    except ValueError as exc:
        raise from_value_error(exc) from None
