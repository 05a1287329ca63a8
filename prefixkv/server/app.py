"""Assemble the FastAPI app around an already loaded Engine.

The engine is built before the app (loading weights takes seconds), so uvicorn only starts accepting
connections once /health can answer ok. The engine thread starts and stops with the app's lifespan.
With a disk KV tier, the /v1/caches entries are read back from its directory here and written there
(cache_store_file.py) until the lifespan ends.
The app carries its ServerLimits (app.state.limits); serving.make_server reads the connection-level ones there.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from prefixkv.engine.client import EngineClient
from prefixkv.server import admin, caches, chat, completions, gemini, messages, prewarm, responses, tokenize
from prefixkv.server.async_engine import AsyncEngine
from prefixkv.server.auth import KeyRing, authenticate, isolation_mode, require_admin
from prefixkv.server.cache_store_file import open_cache_store
from prefixkv.server.errors import install_error_handlers
from prefixkv.server.metrics import ServerMetrics
from prefixkv.server.openapi import install_openapi
from prefixkv.server.options import ServingOptions
from prefixkv.server.request_body import BoundedRequestBody
from prefixkv.server.state import ServerState


def build_app(engine: EngineClient, options: ServingOptions | None = None) -> FastAPI:
    """The app serving `engine` as `options` say (defaults: no keys, default caps and limits)."""
    options = options or ServingOptions()
    keys = KeyRing.build(options.api_key, options.api_key_file)
    tenant_isolation = isolation_mode(options.tenant_isolation, options.api_key_file)
    name = options.served_model_name or engine.model_name
    metrics = ServerMetrics(name, engine.kernels)
    limits = options.limits
    async_engine = AsyncEngine(
        engine,
        on_finished=metrics.observe_finished,
        on_aborted=metrics.observe_aborted,
        max_backlog=limits.max_stream_queue,
    )
    cache_store, cache_file = open_cache_store(engine, name)  # with a disk tier, what the last run left there
    state = ServerState(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        served_model_name=name,
        max_model_len=engine.max_model_len,
        page_size=engine.config.tokens_per_page,
        metrics=metrics,
        keys=keys,
        tenant_isolation=tenant_isolation,
        max_n=options.max_n,
        max_prompts_per_request=options.max_prompts_per_request,
        allow_special_tokens_in_content=options.allow_special_tokens_in_content,
        clamp_max_tokens=options.clamp_max_tokens,
        prefix_caching=engine.config.prefix_cache != "off",
        caches=cache_store,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            try:
                if cache_file is not None:  # before the engine closes and lets its tier directory go
                    cache_file.close()
            finally:
                async_engine.shutdown()
                state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="prefixkv", lifespan=lifespan)
    app.state.server = state
    app.state.limits = limits
    app.add_middleware(BoundedRequestBody, max_bytes=limits.max_request_body_bytes, timeout=limits.body_timeout)
    install_error_handlers(app)
    app.include_router(admin.public)
    routers = (
        admin.router,
        completions.router,
        chat.router,
        messages.router,
        responses.router,
        prewarm.router,
        caches.router,
        gemini.router,
        tokenize.router,
    )
    for router in routers:
        app.include_router(router, dependencies=[Depends(authenticate)])
    app.include_router(admin.admin_only, dependencies=[Depends(require_admin)])
    install_openapi(app, state)
    return app
