"""The options of `prefixkv bench serve --trace DIR` (agent sessions, session_replay.py), apart so that
serve_client.py can add them without importing the replay (which imports serve_client)."""

from __future__ import annotations

import argparse


def add_session_arguments(t: argparse._ArgumentGroup) -> None:
    """The session replay's options (the trace group of `bench serve`)."""
    t.add_argument("--sessions", type=int, default=4, help="agent traces: sessions drawn (seeded by --seed)")
    t.add_argument("--stagger-s", type=float, default=2.0, help="agent traces: sessions start within this many s")
    t.add_argument("--think-scale", type=float, default=1.0, help="agent traces: think times x this")
    t.add_argument("--max-think-s", type=float, default=3600.0, help="agent traces: longer pauses are cut to this")
    t.add_argument(
        "--sim-kv-cache-tokens",
        type=int,
        default=None,
        help="agent traces: also simulate the slice with this pool (the server's) and print the predicted JCTs",
    )
    t.add_argument("--sim-cost-model", default="smollm2-cpu-2t", help="agent traces: the simulator's cost model")
