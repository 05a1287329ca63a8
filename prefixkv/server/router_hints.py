"""What a router in front of this server knows about a request and the engine cannot: passed on as a header.

  x-prefixkv-held-elsewhere   how many leading prompt tokens another replica holds, by the router's index: what
                              this replica misses of them is the router's miss (cache miss cause `routed`)
Behind Ray Serve the replica sets it from what Router.route recorded (serve_ray/replica.py) and the ingress drops
the header from what clients send, so a client cannot relabel its misses there; a gateway of one's own in front
of `prefixkv serve` replicas may set it the same way. It only labels misses: nothing is served differently.
"""

from __future__ import annotations

from fastapi import Request

from prefixkv.server.errors import APIError

HELD_ELSEWHERE = "x-prefixkv-held-elsewhere"
_MAX_DIGITS = 12  # far above any context length; keeps int() away from huge digit strings


def held_elsewhere_tokens(raw: Request) -> int:
    """The header's token count (0 without it); anything but a plain non-negative integer is a 400 naming it."""
    value = raw.headers.get(HELD_ELSEWHERE)
    if value is None:
        return 0
    value = value.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS):
        raise APIError(
            f"header {HELD_ELSEWHERE} must be a number of tokens (an integer >= 0)",
            param=HELD_ELSEWHERE,
            code="invalid_value",
        )
    return int(value)
