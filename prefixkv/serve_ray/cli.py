"""`prefixkv serve --replicas N` with N above 1: the single-process server's flags, the engines as Ray Serve
replicas behind one ingress (prefixkv/cli.py sends it here; `python -m prefixkv.server` stays single-process)."""

from __future__ import annotations

import argparse
import logging

from prefixkv.engine_args import engine_config
from prefixkv.serve_ray.deployment import run
from prefixkv.server.cli import checked_app_options


def serve_replicas(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app_options = checked_app_options(args)
    if app_options is None:
        return 2
    run(
        engine_config(args),
        args.replicas,
        host=args.host,
        port=args.port,
        ray_address=args.ray_address,
        policy=args.router,
        app_options=app_options,
    )
    return 0
