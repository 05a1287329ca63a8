"""The AMX kernels' check on this machine, run once per native build in a subprocess of its own.

Why a subprocess: AMX needs the OS to grant the tile state and a correct tile configuration; a kernel that gets
either wrong faults (SIGSEGV, SIGILL) instead of raising, and that must not take an engine down. So before the
"amx" paths are offered (matmul and attention), `python -m prefixkv.model.amx_selftest` runs the hardware kernels
and checks that (1) they agree with the same kernels on emulated tiles and with the AVX512_BF16 ones to within
bf16 rounding, and (2) every row's bits are the same in any batch, and a decode's are those of the same row in a
prefill (the properties cache-invariant bf16 relies on): the matrix product on SmolLM2's shapes and on shapes
with every kind of tail, attention on rows and decodes around its 16-row tiles and 64-key chunks. Exit status 0
and "ok" on stdout when all holds; the caller (native.amx_gemm) keeps the verdict in the build directory.
"""

from __future__ import annotations

import sys

import torch

SHAPES = ((960, 576), (576, 1536), (130, 64), (72, 40))  # qkv, down, a column tail, K not a whole tile
ROWS = (1, 5, 16, 17, 33, 70)


def check(module, kernel=None, attention_isa: int = 1) -> str | None:
    """None when the matrix product `kernel` (default: the hardware module.amx_gemm) and attention with
    `attention_isa` (1: the hardware, 2: emulated tiles) pass, else what failed."""
    if kernel is None:
        if not module.has_amx():
            return "the CPU or the OS does not offer AMX tiles (cpuid / arch_prctl)"
        kernel = module.amx_gemm
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        packed = module.gemm_pack(weight)
        x = torch.randn(max(ROWS), k, generator=gen).to(torch.bfloat16)
        full = kernel(x, packed, n)
        for name, other in (("emulated tiles", module.amx_gemm_emulated), ("AVX512_BF16", module.gemm)):
            want = other(x, packed, n).float()
            # two bf16 roundings apart at most, plus float32 sums in another order
            if not torch.allclose(full.float(), want, rtol=2**-7, atol=1e-4 * k):
                return f"[{n}, {k}]: differs from {name} by {(full.float() - want).abs().max().item():.3g}"
        for m in ROWS:
            for first in (0, max(ROWS) - m):
                part = kernel(x[first : first + m].clone(), packed, n)
                if not torch.equal(part, full[first : first + m]):
                    return (
                        f"[{n}, {k}]: rows [{first}, {first + m}) differ from the same rows in a {max(ROWS)}-row call"
                    )
    return None


def main(argv: list[str]) -> int:
    from prefixkv.model import native

    torch.set_num_threads(2)
    module = native.module()
    if module is None:
        print("the native kernels are not built")
        return 1
    failure = check(module)
    print(failure or "ok")
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
