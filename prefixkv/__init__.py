"""prefixkv: an LLM serving engine that never computes the same KV twice."""
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
