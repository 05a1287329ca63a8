"""`prefixkv serve`: load the engine, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from prefixkv.engine_args import add_engine_args, engine_config
from prefixkv.prewarm import prewarm_from_file, read_prewarm_file
from prefixkv.router import POLICIES
from prefixkv.server.auth import DEFAULT_TENANT, TENANT_ISOLATION, KeyFileError, read_key_file
from prefixkv.server.limits import add_limit_arguments, limits_from_args
from prefixkv.server.options import CLAMP_APIS, DEFAULT_CLAMP_MAX_TOKENS, ServingOptions
from prefixkv.server.protocol import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The engine options shared with `prefixkv generate` (one definition, in prefixkv.engine_args), plus HTTP
    ones."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (an admin key of "
        f"tenant '{DEFAULT_TENANT}')",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="many keys, one 'KEY TENANT [ROLE]' per line (ROLE user by default, or admin; '#' starts a "
        "comment); only admin keys may reset the cache or read /cache/tree",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients must send (default: the model's)")
    p.add_argument(
        "--tenant-isolation",
        choices=TENANT_ISOLATION,
        default=None,
        help="who shares prefix-cache pages: 'api-key' = the tenant of the caller's key (the default "
        "with --api-key-file); 'user' = the request's `user` field, trusted as sent, so only "
        "behind a proxy that sets it (with keys, scoped by the key's tenant); 'none' = everyone, "
        "split only by the client's cache_salt (the default otherwise)",
    )
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="most completions per prompt (n) in a request")
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
        help="most prompts in one /v1/completions request (also the most completions, prompts x n)",
    )
    p.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="parse special-token text in chat message content as control tokens (lets a client "
        "forge turns; off by default)",
    )
    p.add_argument(
        "--clamp-max-tokens",
        type=_clamp_apis,
        default=DEFAULT_CLAMP_MAX_TOKENS,
        metavar="APIS",
        help="the APIs whose max_tokens, when past what the context leaves, is lowered to what fits (the answer "
        "ends with the API's length finish reason) instead of refused with a 400: a comma list of "
        f"{', '.join(CLAMP_APIS)}, or all, or none (default: messages, as Claude Code asks for 32000)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas; above 1 they run as a Ray Serve deployment behind one ingress on --host/--port "
        "(needs the `ray` extra; a local Ray unless --ray-address)",
    )
    p.add_argument(
        "--router",
        default="round-robin",
        choices=sorted(POLICIES),
        help="how the ingress picks a replica (with --replicas above 1)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster to run the replicas on (e.g. 'auto' on a cluster node); default: start one",
    )
    p.add_argument(
        "--prewarm",
        default=None,
        metavar="FILE",
        help="JSONL of prompts to compute and cache before the server reports ready: one "
        '{"prompt": ...} or {"messages": [...]} per line (optional "cache_salt", "prompt_cache_retention")',
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_limit_arguments(p)


def _clamp_apis(value: str) -> frozenset[str]:
    names = {v.strip() for v in value.split(",") if v.strip()}
    if names == {"all"}:
        return frozenset(CLAMP_APIS)
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - set(CLAMP_APIS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown API {unknown[0]!r}: give {', '.join(CLAMP_APIS)}, all or none")
    return frozenset(names)


def checked_app_options(args: argparse.Namespace) -> ServingOptions | None:
    """The server app's options from the flags, or None after printing why they are unusable (before any model
    loads: a typo in the key file should cost no wait). Shared with the Ray Serve replicas (prefixkv.serve_ray)."""
    if args.api_key_file is not None:
        try:
            read_key_file(args.api_key_file)
        except KeyFileError as exc:
            print(f"prefixkv serve: error: {exc}", file=sys.stderr)
            return None
    if args.replicas < 1:
        print(f"prefixkv serve: error: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return None
    if getattr(args, "prewarm", None) is not None:
        if args.replicas > 1:
            print("prefixkv serve: error: --prewarm is for one engine (not with --replicas above 1)", file=sys.stderr)
            return None
        try:
            read_prewarm_file(args.prewarm)
        except (OSError, ValueError) as exc:
            print(f"prefixkv serve: error: --prewarm: {exc}", file=sys.stderr)
            return None
    try:
        return ServingOptions(
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            api_key_file=args.api_key_file,
            tenant_isolation=args.tenant_isolation,
            max_n=args.max_n,
            max_prompts_per_request=args.max_prompts_per_request,
            allow_special_tokens_in_content=args.allow_special_tokens_in_content,
            clamp_max_tokens=args.clamp_max_tokens,
            limits=limits_from_args(args),
        )
    except ValueError as exc:  # --max-n 0: said before the model loads, not after
        print(f"prefixkv serve: error: {exc}", file=sys.stderr)
        return None


def serve(args: argparse.Namespace) -> int:
    """One process, one engine. `--replicas` above 1 is `prefixkv serve`'s (prefixkv/cli.py hands it to
    prefixkv.serve_ray, which builds on this package)."""
    from prefixkv.llm import build_engine
    from prefixkv.server.app import build_app
    from prefixkv.server.cache_store_file import CacheEntriesFileError
    from prefixkv.server.engine_thread import on_short_lived_thread
    from prefixkv.server.serving import make_server, raise_open_files_limit

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app_options = checked_app_options(args)
    if app_options is None:
        return 2
    if args.replicas > 1:
        print("prefixkv serve: error: --replicas above 1 runs through `prefixkv serve` (Ray Serve)", file=sys.stderr)
        return 2
    raise_open_files_limit(app_options.limits)
    # built and prewarmed on a thread that ends, so the engine thread is the only one left running kernels
    engine = on_short_lived_thread(lambda: build_engine(engine_config(args)))
    if args.prewarm is not None:  # before the app exists: /health answers only once the prefixes are cached
        started = time.perf_counter()
        try:
            num_prompts, num_cached = on_short_lived_thread(lambda: prewarm_from_file(engine, args.prewarm))
        except ValueError as exc:
            print(f"prefixkv serve: error: --prewarm: {exc}", file=sys.stderr)
            return 2
        logging.getLogger(__name__).info(
            "prewarmed %d prompt(s) from %s: %d tokens cached in %.1f s",
            num_prompts,
            args.prewarm,
            num_cached,
            time.perf_counter() - started,
        )
    try:
        app = build_app(engine, app_options)
    except CacheEntriesFileError as exc:  # --kv-offload-on-mismatch refuse: said, not a traceback
        print(f"prefixkv serve: error: {exc}", file=sys.stderr)
        engine.close()
        return 2
    make_server(app, host=args.host, port=args.port, log_level=args.log_level).run()
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
