"""What the CPU under this process is and which of the instruction sets the native kernels use it has.

Read from /proc/cpuinfo (Linux; elsewhere nothing is known and every check says no), so it costs no torch import
and can label a benchmark or a log line. The kernels themselves are compiled with -march=native, so what they can
run is decided by the build (prefixkv.model.native); this module says what the CPU offers, which the tests use to
tell "this CPU lacks the instructions" (skip) from "the build lost them" (fail).
"""

from __future__ import annotations

import functools
import platform

# the instruction sets the kernels are written for, as /proc/cpuinfo spells them
AVX512_BF16 = "avx512_bf16"
AMX_BF16 = "amx_bf16"
AMX_TILE = "amx_tile"
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    AVX512_BF16,
    "avx512_fp16",
    "avx512_vnni",
    AMX_TILE,
    AMX_BF16,
)


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (all processors of these VMs are the same model)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def model_name() -> str:
    """E.g. 'AMD EPYC' or 'Intel(R) Xeon(R) Platinum 8480+'; the machine name where /proc/cpuinfo is missing."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def vendor() -> str:
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(_cpuinfo().get("vendor_id", ""), "other")


@functools.lru_cache(maxsize=1)
def flags() -> frozenset[str]:
    return frozenset((_cpuinfo().get("flags") or _cpuinfo().get("Features") or "").split())


def has(flag: str) -> bool:
    return flag in flags()


def has_amx() -> bool:
    """AMX tiles with bf16 dot products (Intel Xeon since Sapphire Rapids)."""
    return has(AMX_TILE) and has(AMX_BF16)


def describe() -> dict:
    """The CPU as benchmark JSON records it: model, vendor, logical CPUs and the kernel-relevant flags present."""
    import os

    return {
        "model": model_name(),
        "vendor": vendor(),
        "family": _cpuinfo().get("cpu family", ""),
        "model_id": _cpuinfo().get("model", ""),
        "logical_cpus": os.cpu_count(),
        "flags": [f for f in KERNEL_FLAGS if has(f)],
    }
