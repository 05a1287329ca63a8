"""The AMX attention's own self-test and gate (prefixkv.model.amx_selftest, native.amx_attention).

The hardware kernels run only on a CPU with AMX tiles; the self-test's logic runs everywhere on the emulated tiles
(csrc/amx.h), and a deliberately wrong kernel shows that it fails and that the engine then keeps the AMX attention
off, whatever the matrix product's verdict.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prefixkv.model import amx_selftest, cpu_features, native
from prefixkv.model.amx_selftest import ISA_EMULATED, ISA_VECTOR, AttentionKernels, attention_kernels
from prefixkv.model.options import KernelOptions
from tests import kernels

pytestmark = kernels.GEMM  # the AMX kernels, emulated tiles included, are in the AVX512_BF16 build


def inaccurate_kernels(module) -> AttentionKernels:
    """Emulated tiles with every output 1% off: invariant, but not the attention the vector path computes."""
    emulated = attention_kernels(module, ISA_EMULATED)

    def scaled(kernel, *args, **kwargs):
        out, *rest = kernel(*args, **kwargs)
        return (out.float() * 1.01).to(out.dtype), *rest

    return AttentionKernels(functools.partial(scaled, emulated.prefill), functools.partial(scaled, emulated.decode))


def chunk_dependent_kernels(module) -> AttentionKernels:
    """Accurate everywhere, but a one-row call takes the vector path: a decode's bits then depend on its batch."""
    emulated, vector = attention_kernels(module, ISA_EMULATED), attention_kernels(module, ISA_VECTOR)

    def by_rows(name, q, *args, **kwargs):
        return getattr(vector if q.shape[0] == 1 else emulated, name)(q, *args, **kwargs)

    return AttentionKernels(functools.partial(by_rows, "prefill"), functools.partial(by_rows, "decode"))


def test_the_emulated_tiles_pass_and_wrong_kernels_fail():
    module = native.module()
    assert amx_selftest.check_attention(module, attention_kernels(module, ISA_EMULATED)) is None
    assert "differs from emulated tiles" in amx_selftest.check_attention(module, inaccurate_kernels(module))
    failure = amx_selftest.check_attention(module, chunk_dependent_kernels(module))
    assert failure is not None and "attention" in failure


@pytest.fixture
def amx_machine(monkeypatch, tmp_path):
    """This machine as one with AMX tiles, verdicts kept in a fresh directory, the gates' caches cleared."""
    module = native.module()
    monkeypatch.setattr(cpu_features, "has_amx", lambda: True)
    monkeypatch.setattr(module, "has_amx", lambda: True)
    monkeypatch.setattr(native, "build_directory", lambda: str(tmp_path))
    gates = (native.amx_status, native.amx_gemm, native.amx_attention)

    def clear():
        for gate in gates:
            gate.cache_clear()

    clear()
    yield monkeypatch
    monkeypatch.undo()
    clear()


def _attention_self_test(monkeypatch, *extra: str) -> None:
    command = native.selftest_command
    monkeypatch.setattr(
        native, "selftest_command", lambda family: command(family) + (list(extra) * (family == "attention"))
    )


def test_a_failed_attention_self_test_keeps_amx_attention_off(amx_machine):
    """The gate runs the self-test in its own process; its verdict alone decides, and the start line says it."""
    _attention_self_test(amx_machine, "--kernels", f"{__name__}:inaccurate_kernels")
    assert native.amx_attention() is None
    assert native.amx_status("attention").startswith("self-test failed: attention prefill: differs from emulated")
    options = KernelOptions.choose("cpu", torch.bfloat16)
    assert options.native_attention and not options.amx_attention
    with pytest.raises(ValueError, match="amx_attention needs .*self-test failed"):
        KernelOptions.choose("cpu", torch.bfloat16, amx_attention=True)
    assert "attention self-test failed" in native.amx_line()


def test_a_passing_attention_self_test_opens_its_own_gate_only(amx_machine):
    """Emulated tiles in place of the hardware pass; the matrix product's self-test (the real hardware kernel,
    which this CPU cannot run) fails on its own, and each gate follows its own verdict."""
    if cpu_features.has(cpu_features.AMX_BF16):
        pytest.skip("on a CPU with AMX tiles the hardware matrix product would pass")
    _attention_self_test(amx_machine, "--isa", str(ISA_EMULATED))
    assert native.amx_status("attention") == "ok"
    assert native.amx_attention() is not None
    assert native.amx_gemm() is None and native.amx_status("gemm").startswith("self-test failed")
    options = KernelOptions.choose("cpu", torch.bfloat16)
    assert options.amx_attention and options.matmul != "amx"
