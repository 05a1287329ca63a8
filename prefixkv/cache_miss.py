"""Why a request's prompt was not all served from the prefix cache: the answer the engine gives per request.

Every prompt misses at least its last token (its logits are needed), so every admitted request has one. The KV
manager fills it in at first admission (kvcache/miss_reasons.py says how each cause is told apart); the server
shows it on request (`usage.prompt_tokens_details.cache_miss`) and /metrics sums the tokens by cause.

Causes, in the order a missed page is tested for them:
- in_flight: another running request is computing that page right now (it was not findable when this one came).
- routed: another replica holds the page (only where something sees the fleet: the replica simulator, or a
  router's index, which tells the replica it routes to how many leading prompt tokens another one holds).
- evicted: the page was cached and dropped to make room (`policy`: the eviction policy, or "reset" for an admin
  reset; `evicted_s_ago`: how long before this request's admission).
- expired: the page was cached under a retention (a TTL, a cache breakpoint) that ran out, and was evicted after,
  while an endless retention would still have held it (else the cap, not the TTL, let it go: evicted).
- isolated: the same tokens are cached, but under another tenant's salt or another adapter.
- unknown: a page with these tokens was evicted so long ago that the engine's bounded eviction history no longer
  holds the eviction (it keeps a filter of what fell out: such a page never reads never_seen); the simulator,
  which keeps every eviction, has none.
- never_seen: no page with these tokens was ever cached (compulsory: no cache could have served it).
- store_down: the shared KV store (`--kv-remote`) was not answering when the request was admitted, so the pages
  this replica had not cached (never_seen, evicted, expired, unknown here) could not be looked up there: misses a
  working store might have served, as another replica may have stored them.
- granularity: the tail no hit can cover: a partial last page, and the last token (always recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CAUSES = ("in_flight", "evicted", "expired", "isolated", "unknown", "never_seen", "granularity", "routed", "store_down")
# the causes of pages this replica does not hold that a shared store could hold (not another tenant's, not in flight)
STORE_COULD_SERVE = ("evicted", "expired", "unknown", "never_seen")


@dataclass(slots=True)
class CacheMiss:
    first_missed_token: int  # the prompt's first token not served from the cache (== the hit, in tokens)
    cause: str  # why that token missed (one of CAUSES)
    tokens_by_cause: dict[str, int] = field(default_factory=dict)  # every missed prompt token, by cause
    policy: str | None = None  # evicted / expired: what evicted the first missed page
    evicted_s_ago: float | None = None  # evicted / expired: seconds between that eviction and the request's admission

    @property
    def missed_tokens(self) -> int:
        return sum(self.tokens_by_cause.values())

    def with_store_down(self) -> CacheMiss:
        """The same misses with the shared store down: the tokens a store could have served are store_down."""
        moved = sum(self.tokens_by_cause.get(c, 0) for c in STORE_COULD_SERVE)
        if not moved:
            return self
        tokens = {c: n for c, n in self.tokens_by_cause.items() if c not in STORE_COULD_SERVE}
        tokens["store_down"] = tokens.get("store_down", 0) + moved
        first_is_moved = self.cause in STORE_COULD_SERVE
        return CacheMiss(
            self.first_missed_token,
            "store_down" if first_is_moved else self.cause,
            tokens,
            None if first_is_moved else self.policy,
            None if first_is_moved else self.evicted_s_ago,
        )

    def to_json(self) -> dict:
        out: dict = {
            "first_missed_token": self.first_missed_token,
            "cause": self.cause,
            "tokens_by_cause": dict(self.tokens_by_cause),
        }
        if self.policy is not None:
            out["policy"] = self.policy
        if self.evicted_s_ago is not None:
            out["evicted_s_ago"] = round(self.evicted_s_ago, 3)
        return out
