"""What a router knows about one replica at the moment it routes: load gauges, nothing about the model.

The server exposes the same gauges (waiting, running, KV usage, cached blocks) on /metrics and its load endpoint;
the simulator reads them off each replica's scheduler. Everything a policy scores on is here, so one policy runs
unchanged behind Ray Serve, an HTTP gateway or the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaState:
    replica_id: str
    waiting: int = 0  # requests queued, not yet admitted
    running: int = 0  # requests admitted (prefilling or decoding)
    kv_usage: float = 0.0  # fraction of the KV pool held by requests (0..1)
    cached_blocks: int = 0  # blocks the prefix cache holds (findable by a lookup)
    pending_prefill_tokens: int = 0  # prompt tokens its queued and running requests have still to compute
    active_blocks: int = 0  # KV blocks its running requests hold: what their decodes attend over

    @property
    def load(self) -> int:
        """Requests in flight: SGLang's and Ray Serve's load measure."""
        return self.waiting + self.running
