"""prefixkv: an LLM serving engine that never computes the same KV twice."""

import os

# OpenMP threads that spin while idle make every op wait for a descheduled thread when the cores are shared
# (10x slower steps seen here); must be set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from prefixkv.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):  # LLM pulls in torch; keep `import prefixkv` light for the cache and scheduler
    if name == "LLM":
        from prefixkv.llm import LLM

        return LLM
    if name == "EngineConfig":
        from prefixkv.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
