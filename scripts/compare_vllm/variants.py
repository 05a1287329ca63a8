"""vLLM's configurations a comparison measures: a fair peer runs in the configuration that suits it best here.

- `vllm`: bf16, vLLM's OpenMP threads on the comparison's cores (VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)).
- `vllm_fp32`: float32, where the CPU has no bf16 instructions (neither AVX512_BF16 nor AMX, e.g. an AMD EPYC Zen 3):
  vLLM's CPU build (like torch) then emulates bf16, and prefixkv's own start log tells its users float32 is faster
  there, so vLLM is given float32 too.
- `vllm_reserved` (and `vllm_fp32_reserved`): the served rows with one of the comparison's cores kept from vLLM's
  OpenMP threads for its API server process (VLLM_CPU_NUM_OF_RESERVED_CPU=1, the binding one core shorter), as
  vLLM's CPU docs suggest for serving; the cores in all stay the comparison's. Only with 2 threads or more.
Per row the report keeps the vLLM configuration with the better median (compare_vllm.report).
"""

from __future__ import annotations

import dataclasses

NAMES = ("vllm", "vllm_fp32", "vllm_reserved", "vllm_fp32_reserved")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # cpu_features.describe()'s names of the bf16 instructions


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # one of NAMES (report.VLLM_VARIANTS says what each changes)
    dtype: str  # bfloat16 | float32
    reserved_cpus: int  # cores kept from vLLM's OpenMP threads for its API server
    row_groups: tuple[str, ...]  # which of offline / serve it runs

    def env(self, threads: int) -> dict[str, str]:
        """vLLM's CPU placement: its OpenMP threads bound to the comparison's first cores, less the reserved."""
        return {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1 - self.reserved_cpus}",
        }

    def describe(self) -> dict:
        return {"dtype": self.dtype, "reserved_cpus": self.reserved_cpus, "rows": list(self.row_groups)}


def has_bf16(cpu: dict) -> bool:
    return any(flag in cpu.get("flags", ()) for flag in BF16_FLAGS)


def choose(requested: str, cpu: dict, threads: int, row_groups: list[str]) -> list[Variant]:
    """The configurations to run, plain `vllm` first. requested: "auto" (float32 where the CPU has no bf16
    instructions; the reserved core on the served rows where threads >= 2), "none" (plain bf16 only) or a
    comma-separated list of NAMES (ValueError for an unknown name or one that cannot run here)."""
    if requested == "auto":
        names = ["vllm", *(["vllm_fp32"] if not has_bf16(cpu) else [])]
        if "serve" in row_groups and threads >= 2:
            names += [n + "_reserved" for n in names]
    elif requested == "none":
        names = ["vllm"]
    else:
        names = ["vllm", *(n.strip() for n in requested.split(",") if n.strip() and n.strip() != "vllm")]
        unknown = [n for n in names if n not in NAMES]
        if unknown:
            raise ValueError(f"unknown vLLM configuration(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    variants = []
    for name in dict.fromkeys(names):
        reserved = 1 if name.endswith("_reserved") else 0
        if reserved and threads < 2:
            raise ValueError(f"{name} keeps a core for vLLM's API server: it needs --threads 2 or more")
        groups = tuple(g for g in row_groups if g == "serve" or not reserved)  # a reserved core serves only
        if groups:
            variants.append(Variant(name, "float32" if "fp32" in name else "bfloat16", reserved, groups))
    return variants
