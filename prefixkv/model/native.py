"""prefixkv's compiled CPU kernels (prefixkv/model/csrc): in-place paged decode attention and one-pass bf16
SiLU-multiply, RMSNorm and rotary embedding.

They are built with torch's extension builder the first time they are asked for (about a minute; scripts/setup.sh
does it once, and torch caches the build by source hash). Anything that goes wrong (no compiler, headers, ...) is
reported once as a warning and the callers keep their torch paths, which compute the same results.
"""
from __future__ import annotations

import functools
import glob
import os
import sys
import warnings

_SOURCES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.cpp")))


@functools.lru_cache(maxsize=1)
def module():
    """The compiled module, or None when it cannot be built here (PREFIXKV_NO_NATIVE=1 forces None)."""
    if os.environ.get("PREFIXKV_NO_NATIVE") == "1":
        return None
    bin_dir = os.path.dirname(sys.executable)  # pip's ninja lives beside python in a venv that is not activated
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name="prefixkv_native",
            sources=_SOURCES,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or headers must not stop the engine
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        warnings.warn(f"prefixkv: native CPU kernels unavailable, using torch ops ({reason})")
        return None


def fused_ops():
    """The module when its one-pass bf16 elementwise kernels are compiled in (AVX-512), else None."""
    m = module()
    return m if m is not None and m.has_fused_ops() else None
