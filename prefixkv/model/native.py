"""The one compiled kernel prefixkv ships: decode attention read in place from the paged KV pool (CPU).

It is built from prefixkv/model/csrc/paged_decode.cpp with torch's extension builder the first time it is asked
for (about a minute; scripts/setup.sh does it once, and torch caches the build by source hash). Anything that
goes wrong (no compiler, not Linux x86, ...) is reported once as a warning and the caller falls back to the
gather + SDPA path, which computes the same attention.
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


@functools.lru_cache(maxsize=1)
def paged_decode_module():
    """The compiled module, or None when it cannot be built here (PREFIXKV_NO_NATIVE=1 forces None)."""
    if os.environ.get("PREFIXKV_NO_NATIVE") == "1":
        return None
    bin_dir = os.path.dirname(sys.executable)  # pip's ninja lives beside python in a venv that is not activated
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name="prefixkv_paged_decode",
            sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or headers must not stop the engine
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        warnings.warn(f"prefixkv: native paged decode kernel unavailable, using gather + SDPA ({reason})")
        return None
