"""Build and run the Ray Serve application: N EngineReplica replicas routed by PrefixkvRequestRouter, one Ingress.

On an existing Ray cluster (multi-node): `ray.init(address="auto")`, then `serve.run(build_application(...))`
(or `prefixkv serve --replicas N --ray-address auto`). Each replica loads the weights itself, so the model path in
the EngineConfig must be readable on every node (or left as the packaged default).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixkv.config import EngineConfig
from prefixkv.serve_ray.ingress import Ingress
from prefixkv.serve_ray.replica import EngineReplica
from prefixkv.serve_ray.request_router import PrefixkvRequestRouter


def build_application(
    config: EngineConfig,
    replicas: int,
    *,
    policy: str = "round-robin",
    policy_options: dict[str, Any] | None = None,
    app_options: dict[str, Any] | None = None,
    max_ongoing_requests: int = 64,
) -> Any:
    """The Serve application (pass to serve.run). Each replica gets one torch thread unless config says more, and
    reserves that many CPUs from Ray. `app_options` are build_app's keyword options (api_key, max_n, ...)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    from prefixkv.router import create_policy

    create_policy(policy, **(policy_options or {}))  # a bad name or option fails here, not inside Ray
    threads = config.num_threads or 1
    engine = serve.deployment(EngineReplica).options(
        name="EngineReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": threads},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixkvRequestRouter,
            request_router_kwargs={"policy": policy, **(policy_options or {})},
            request_routing_stats_period_s=1.0,
        ),
    )
    return Ingress.bind(engine.bind(replace(config, num_threads=threads), app_options or {}))


def run(
    config: EngineConfig,
    replicas: int,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_address: str | None = None,
    blocking: bool = True,
    **options: Any,
) -> Any:
    """Start (or join, with ray_address) Ray, then Serve on host:port with the application; returns its handle."""
    import ray

    ray.init(address=ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_application(config, replicas, **options), blocking=blocking)
