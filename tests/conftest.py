"""Shared fixtures: engines on the real default model, built once per session and reused."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before anything imports torch (see prefixkv/__init__.py)


@pytest.fixture(scope="session")
def llm_factory():
    """llm_factory(**engine_options) -> a cached LLM on the default model (fp32) for those options."""
    from prefixkv.llm import LLM

    cache: dict = {}

    def make(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = LLM(**options)
        return cache[key]

    return make
