"""Build and run the Ray Serve application: N EngineReplica replicas routed by PrefixkvRequestRouter, one Ingress.

On an existing Ray cluster (multi-node): `ray.init(address="auto")`, then `serve.run(build_application(...))`
(or `prefixkv serve --replicas N --ray-address auto`). Each replica loads the weights itself, so the model path in
the EngineConfig must be readable on every node (or left as the packaged default).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, cast

from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixkv.config import EngineConfig
from prefixkv.serve_ray.ingress import Ingress
from prefixkv.serve_ray.replica import EngineReplica
from prefixkv.serve_ray.request_router import PrefixkvRequestRouter
from prefixkv.server.options import ServingOptions

CACHE_AWARE = ("approximate", "precise")  # policies that read the prompt's tokens (precise: and KV events)
# Ray starts its worker processes (the replicas) at niceness 15: any other process on the node then takes the CPU
# first. Under a 2-thread load on 2 cores, 6 concurrent 16-token requests took 56-70 s through two replicas at 15,
# against 2.3 s for one `prefixkv serve` beside the same load. A local Ray that prefixkv starts runs them at 0.
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


def init_ray(address: str | None = None, **options: Any) -> None:
    """ray.init; a local Ray started here runs its workers at niceness 0 (WORKER_NICENESS says why). A cluster
    joined by address keeps its own setting: start it with RAY_worker_niceness=0 (docs/replicas.md)."""
    import ray

    if address is None:
        for key, value in WORKER_NICENESS.items():
            os.environ.setdefault(key, value)
    ray.init(address=address, **options)


def build_application(
    config: EngineConfig,
    replicas: int,
    *,
    policy: str = "round-robin",
    policy_options: dict[str, Any] | None = None,
    app_options: ServingOptions | None = None,
    max_ongoing_requests: int = 64,
) -> Any:
    """The Serve application (pass to serve.run). Each replica gets one torch thread unless config says more, and
    reserves that many CPUs from Ray. `app_options`: how each replica's server serves (keys, caps, limits)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    from prefixkv.router import create_policy

    options = dict(policy_options or {})
    cache_aware = policy in CACHE_AWARE
    if cache_aware:  # hash prompts exactly as the replicas' caches do
        options.setdefault("block_size", config.page_size)
        options.setdefault("hash_algo", config.prefix_caching_hash_algo)
    create_policy(policy, **options)  # a bad name or option fails here, not inside Ray
    threads = config.num_threads or 1
    deployment: Any = serve.deployment(EngineReplica)  # Ray's stubs type the bare decorator call as a decorator
    router_config: dict[str, Any] = {
        "request_router_class": PrefixkvRequestRouter,
        "request_router_kwargs": {"policy": policy, **options},
        "request_routing_stats_period_s": 1.0,
    }
    engine = deployment.options(
        name="EngineReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": threads},
        request_router_config=RequestRouterConfig(**router_config),
    )
    serving = app_options or ServingOptions()
    replica = engine.bind(replace(config, num_threads=threads), serving, policy == "precise")
    return cast(Any, Ingress).bind(replica, config.model, cache_aware, serving)


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
    init_ray(ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_application(config, replicas, **options), blocking=blocking)
