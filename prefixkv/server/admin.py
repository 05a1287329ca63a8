"""Health, model list, Prometheus metrics and the prefix-cache admin endpoints."""
from __future__ import annotations

import time
from dataclasses import asdict, is_dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from prefixkv.server.state import server_state

public = APIRouter()  # no API key needed
router = APIRouter()

_STARTED = int(time.time())


def stats_dict(stats: Any) -> dict:
    if is_dataclass(stats):
        return asdict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


@public.get("/health")
async def health(raw: Request) -> Response:
    state = server_state(raw)
    if not state.engine.is_alive:
        return JSONResponse({"status": "engine dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def list_models(raw: Request) -> dict:
    state = server_state(raw)
    card = {"id": state.served_model_name, "object": "model", "created": _STARTED, "owned_by": "prefixkv",
            "max_model_len": state.max_model_len}
    return {"object": "list", "data": [card]}


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    state = server_state(raw)
    stats = await state.engine.call(lambda engine: engine.get_stats())
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request) -> Response:
    """Drops every cached page no running request holds; 409 when running requests still hold some."""
    ok = await server_state(raw).engine.call(lambda engine: engine.reset_prefix_cache())
    if not ok:
        return JSONResponse({"reset": False, "reason": "running requests still hold cached pages"}, status_code=409)
    return JSONResponse({"reset": True})


@router.get("/cache/summary")
async def cache_summary(raw: Request) -> dict:
    """The engine's cache_summary() plus the counters a person checks first (hit rate, pages held)."""

    def read(engine: Any) -> dict:
        summary = dict(engine.cache_summary())
        summary["engine"] = stats_dict(engine.get_stats())
        return summary

    summary = await server_state(raw).engine.call(read)
    stats = summary["engine"]
    summary.setdefault("hit_rate", stats.get("prefix_cache_hit_rate", 0.0))
    summary["kv_pages_used"] = stats.get("num_pages_used")
    summary["kv_pages_total"] = stats.get("num_pages_total")
    return summary


@router.get("/cache/tree")
async def cache_tree(raw: Request, depth: int = 3, children: int = 5) -> Response:
    """The top of the radix tree as text (what `prefixkv cache-tree --url` prints); 400 for the hash cache."""
    text = await server_state(raw).engine.call(lambda engine: engine.render_cache_tree(depth, children))
    return PlainTextResponse(text)
