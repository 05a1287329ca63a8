"""prefixkv: an LLM serving engine that never computes the same KV twice."""

import os

# How OpenMP workers wait for the next parallel region: a step runs hundreds of short ones (every kernel of every
# layer) microseconds apart. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a wake-up per region: 25-40% of a
# decode-heavy run here. Spinning without end (ACTIVE) makes every op wait for a descheduled worker when the cores
# are shared (10x slower steps seen here). A short spin, then sleep, has neither cost (GNU OpenMP, which torch's CPU
# wheel uses; ~10 µs). Set before torch first loads OpenMP; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

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
