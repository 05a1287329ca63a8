"""Health, model list, Prometheus metrics, router load gauges and the prefix-cache admin endpoints.

Who sees what, once keys are configured: any key may list models, scrape /metrics (server-wide counters, as
vLLM exposes them, no prompt text and nothing per tenant) and read /cache/summary, which an admin key gets
whole and a tenant key gets cut down to its own namespaces. Resetting the cache and the radix tree (it shows
prompt text) need an admin key. Without keys every caller is an admin, as before keys existed.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from prefixkv.kvcache.summary import CacheSummary
from prefixkv.server.auth import (
    TAG_LEN,
    named_owner,
    principal_of,
    request_api_key,
    salt_filter,
    salt_prefix,
    tenant_owner,
)
from prefixkv.server.errors import APIError
from prefixkv.server.state import ServerState, server_state

public = APIRouter()  # no API key needed
router = APIRouter()  # any valid key
admin_only = APIRouter()  # an admin key

_STARTED = int(time.time())


@public.get("/health")
async def health(raw: Request) -> Response:
    state = server_state(raw)
    if not state.engine.is_alive:
        return JSONResponse({"status": "engine dead"}, status_code=503)
    if state.engine.engine.config.kv_remote is not None:  # serving without the shared store is degraded, still serving
        remote = (await state.engine.stats()).kv_remote_status or "ok"
        if remote != "ok":
            return JSONResponse({"status": "degraded", "kv_remote": remote})
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def list_models(raw: Request) -> dict:
    state = server_state(raw)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "prefixkv",
        "max_model_len": state.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    state = server_state(raw)
    stats = await state.engine.stats()
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


@router.get("/load")
async def load(raw: Request) -> dict:
    """The gauges a router scores replicas on, as small JSON (cheaper to poll and parse than /metrics): queue
    lengths, KV pool use and how much the prefix cache holds, plus where its KV events are published."""

    state = server_state(raw)
    stats = await state.engine.stats()
    return {
        "num_requests_waiting": stats.num_waiting,
        "num_requests_running": stats.num_running,
        "kv_cache_usage": stats.kv_usage,
        "num_pages_used": stats.num_pages_used,
        "num_pages_total": stats.num_pages_total,
        "num_cached_pages": stats.num_cached_pages,
        "page_size": state.page_size,
        "kv_events_endpoint": stats.kv_events_endpoint,
    }


@admin_only.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request, tenant: str | None = None) -> Response:
    """Drops every cached page no running request holds, or (?tenant=NAME) only that tenant's namespaces;
    409 when running requests still hold some."""
    state = server_state(raw)
    only = None
    if tenant is not None:
        only = salt_filter(_owner_named(state, tenant))
    ok = await state.engine.reset_prefix_cache(only)
    scope = {} if tenant is None else {"tenant": tenant}
    if not ok:
        return JSONResponse(
            {"reset": False, **scope, "reason": "running requests still hold cached pages"}, status_code=409
        )
    return JSONResponse({"reset": True, **scope})


def _owner_named(state: ServerState, tenant: str) -> str:
    """The owner string behind ?tenant=NAME, or a 400 saying why the name means nothing on this server."""
    owner = named_owner(state.tenant_isolation, state.keys, tenant)
    if owner is None:
        why = (
            "tenants do not have separate caches here (--tenant-isolation none)"
            if state.tenant_isolation == "none"
            else "without --api-key-file, api-key isolation has no tenant names"
        )
        raise APIError(
            f"Cannot reset one tenant: {why}; reset the whole cache instead", param="tenant", code="invalid_value"
        )
    if state.keys is not None and tenant not in state.keys.tenants():
        raise APIError(f"Unknown tenant {tenant!r}: no API key belongs to it", param="tenant", code="invalid_value")
    return owner


@router.get("/cache/summary")
async def cache_summary(raw: Request) -> dict:
    """The engine's cache summary plus the counters a person checks first (hit rate, pages held); for a tenant
    key only the namespaces of its own tenant (see tenant_view)."""
    state = server_state(raw)
    summary, stats = await state.engine.cache_summary()
    principal = principal_of(raw)
    if not principal.is_admin:
        owner = tenant_owner(state.tenant_isolation, principal, request_api_key(raw), None)
        return tenant_view(state, owner, principal.tenant, summary)
    out = summary.to_json()
    out["engine"] = asdict(stats)
    out["kv_pages_used"] = stats.num_pages_used
    out["kv_pages_total"] = stats.num_pages_total
    out["tenant_isolation"] = state.tenant_isolation
    if state.keys is not None and state.tenant_isolation != "none":
        tenant_by_prefix = {salt_prefix("tenant:" + t): t for t in state.keys.tenants()}
        for key in ("by_namespace", "top_prefixes"):  # each row names the key-file tenant its salt belongs to
            for row in out[key]:
                salt = row["cache_salt"]
                row["tenant"] = tenant_by_prefix.get(salt[:TAG_LEN]) if salt is not None else None
    return out


def tenant_view(state: ServerState, owner: str | None, tenant: str | None, summary: CacheSummary) -> dict:
    """What a tenant key may see: the cache's shape and its own namespaces (cached tokens, hits, top prefix
    lengths), never another tenant's namespaces or hit counts, nor the server-wide counters that sum them.
    With isolation off no namespace is the tenant's own, so none is shown."""
    mine = salt_filter(owner) if owner is not None else (lambda salt: False)
    return {
        "tenant": tenant,
        "tenant_isolation": state.tenant_isolation,
        "type": summary.type,
        "page_size": summary.page_size,
        "by_namespace": [asdict(row) for row in summary.by_namespace if mine(row.cache_salt)],
        "top_prefixes": [asdict(row) for row in summary.top_prefixes if mine(row.cache_salt)],
    }


@admin_only.get("/cache/tree")
async def cache_tree(raw: Request, depth: int = 3, children: int = 5) -> Response:
    """The top of the radix tree as text (what `prefixkv cache-tree --url` prints); 400 for the hash cache.
    Admin only: the text is every tenant's prompts."""
    text = await server_state(raw).engine.render_cache_tree(depth, children)
    return PlainTextResponse(text)
