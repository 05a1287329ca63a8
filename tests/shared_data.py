"""The project's shared data: the traces folder beside the repository (`../shared/traces`), too large to ship.

Tests find it relative to the repository, not by an absolute path, so that any checkout finds its own. Without it
a test that needs it is skipped on a developer's machine and fails in CI (`CI=true`), where a missing folder
means the data was not provided and a skip would hide every check that reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = REPO.parent / "shared" / "traces"


def shared_trace(name: str, root: Path | None = None) -> Path:
    """`root / name` (default root: SHARED_TRACES), a file or a folder of the shared traces; skips the calling
    test when it is missing, or fails it under CI=true."""
    path = (root or SHARED_TRACES) / name
    if not path.exists():
        message = f"shared data {path} is missing (the traces folder beside the repository)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + ": CI must provide it")
        pytest.skip(message)
    return path


MOONCAKE = "mooncake_conversation_trace.jsonl"
CLAUDE_CODE = "claude_code"
