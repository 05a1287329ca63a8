"""The native builds the kernel tests run on: the main one (-march=native, what the engine loads) and the AVX2
variant (native.VARIANTS["avx2"]: AVX2 + FMA, no AVX-512, the kernels of an AMD EPYC Zen 3), which
scripts/setup.sh builds beside it so that the AVX2 kernels are checked on AVX-512 CPUs as well.

The variant skips only where the CPU cannot run AVX2 + FMA. Where it can and the variant is missing, the first
test that needs it builds it (3-4 minutes on 2 cores); a build that fails fails the tests under CI=true, and
elsewhere skips them saying why (the main build's tests still fail where that one is broken).
"""

from __future__ import annotations

import functools
import os

import pytest

from prefixkv.model import cpu_features, native

MAIN, AVX2 = "main", "avx2"


@functools.cache
def _variant(name: str) -> tuple[object | None, str]:
    """(module, "") or (None, why not): cached, so a failed build is tried once per session."""
    try:
        return native.variant(name), ""
    except Exception as exc:  # noqa: BLE001 - a compile error, a timeout: reported by the caller
        return None, (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def module(build: str):
    """The module of `build` (MAIN or AVX2), or the test skips / fails as the module's docstring says."""
    if build == MAIN:
        return native.module()
    if not native.variant_runs_here(build):
        needs = ", ".join(native.VARIANTS[build][1])
        pytest.skip(f"the {build} build needs {needs}; this CPU ({cpu_features.model_name()}) lacks some")
    m, why = _variant(build)
    if m is None:
        message = f"the {build} variant of the native kernels cannot be built here: {why}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return m
