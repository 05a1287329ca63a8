"""API-key check and tenant isolation.

Tenant isolation works through the cache key, not through access checks: the cache_salt enters the key of
the first cached block, so two tenants with different salts can never find each other's pages (and so can
never learn, by timing, what another tenant's prompts start with).
"""
from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from prefixkv.server.errors import APIError

TENANT_ISOLATION = ("none", "api-key", "user")


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <key>` matches --api-key (when one is set)."""
    expected: str | None = request.app.state.server.api_key
    if expected is None:
        return
    token = bearer_token(request)
    if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
        raise APIError("Invalid or missing API key: send 'Authorization: Bearer <key>'", status=401,
                       code="invalid_api_key")


def cache_salt_for(mode: str, request: Request, user: str | None, cache_salt: str | None) -> str | None:
    """The salt the engine gets: the client's own cache_salt, bound to the tenant when isolation is on."""
    if mode == "none":
        return cache_salt
    if mode == "api-key":
        tenant = "key:" + (bearer_token(request) or "")
    elif mode == "user":
        tenant = "user:" + (user or "")
    else:
        raise ValueError(f"tenant isolation must be one of {TENANT_ISOLATION}, got {mode!r}")
    material = tenant if cache_salt is None else f"{tenant}\0salt:{cache_salt}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]
