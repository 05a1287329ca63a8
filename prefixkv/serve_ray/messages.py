"""What the ingress and a replica pass each other: one HTTP exchange as plain data (Ray pickles it).

`route` is what the request router reads to choose a replica (prefixkv.router's RouteRequest); Ray hands the
router a request's positional arguments, so the forwarded request carries it rather than the router parsing
HTTP bodies itself. It also carries back what the router learned: the router runs in the caller's process before
Ray serializes the arguments, so the held_elsewhere_tokens Router.route records on it reach the chosen replica
(tests/test_serve_ray.py checks it end to end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixkv.router.request import RouteRequest


@dataclass
class ForwardedRequest:
    method: str
    path: str  # with its query string
    headers: list[tuple[str, str]]
    body: bytes
    route: RouteRequest = field(default_factory=lambda: RouteRequest(token_ids=[]))


@dataclass
class ForwardedResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
