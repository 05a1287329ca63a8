"""N engine replicas as a Ray Serve deployment behind one OpenAI-compatible ingress (`prefixkv serve --replicas N`).

Ray owns scaling, health checks and replica restarts; prefixkv owns which replica a request goes to, through Ray
Serve's own request-router extension point (request_router.py adapts prefixkv.router to it). Each replica runs the
unchanged single-process server app (prefixkv.server.app.build_app) in process, so every endpoint, error and
limit behaves exactly as `prefixkv serve` without replicas. Import this package only with the `ray` extra
installed (`pip install prefixkv[ray]`).
"""

from prefixkv.serve_ray.deployment import build_application, run

__all__ = ["build_application", "run"]
