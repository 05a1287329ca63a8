"""`prefixkv serve`: load the engine, then serve the OpenAI-compatible API with uvicorn."""
from __future__ import annotations

import argparse
import logging

from prefixkv.engine_args import add_engine_args, engine_config
from prefixkv.server.auth import TENANT_ISOLATION


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The engine options shared with `prefixkv generate` (one definition, in prefixkv.engine_args), plus HTTP
    ones."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--served-model-name", default=None, help="the model name clients must send (default: the model's)")
    p.add_argument("--tenant-isolation", choices=TENANT_ISOLATION, default="none",
                   help="derive the cache salt from the API key or the `user` field so tenants never share pages")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixkv.llm import build_engine
    from prefixkv.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(engine_config(args))
    app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                    tenant_isolation=args.tenant_isolation)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixkv.server")
    add_serve_arguments(parser)
    return serve(parser.parse_args(argv))
