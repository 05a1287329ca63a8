"""--kernel-options reaches the runner of a real engine (fp32 default model): a switch forced on, an unknown name
or a path that cannot run here is a ValueError naming it, before the engine serves anything. Engines on one loaded
model share its packed weights."""

from __future__ import annotations

import copy

import pytest

from prefixkv.model import native


def test_engine_kernel_options(new_llm):
    runner = new_llm(kv_cache_tokens=512, kernel_options="cascade_decodes=1,in_place_decodes=0").llm_engine.runner
    assert runner.options.cascade_decodes and not runner.options.in_place_decodes  # fp32 defaults are the reverse
    with pytest.raises(ValueError, match="no_such_switch"):
        new_llm(kv_cache_tokens=512, kernel_options="no_such_switch=1")
    with pytest.raises(ValueError, match="native_attention"):
        new_llm(kv_cache_tokens=512, kernel_options="native_attention=1")  # bf16 only


def test_engines_on_one_loaded_model_share_its_packed_weights(new_llm):
    """matmul.pack keeps a weight's packed copy on the weight: a second engine on the same loaded model reads the
    first one's (not a copy as large as the weights); one on F.linear reads the plain weights. float32 where the
    AVX2 build packs it, else bf16 (oneDNN's or prefixkv's packed weights)."""
    options = {"dtype": "float32" if native.gemm_f32() is not None else "bfloat16", "kv_cache_tokens": 512}
    first = new_llm(**options).llm_engine.runner
    if first.options.matmul == "torch":
        pytest.skip(f"{options['dtype']} reads the plain weights here (no packed copy)")
    second = new_llm(**options).llm_engine.runner

    def gate_up(runner):
        return runner.model.layers[0].mlp.gate_up_proj.packed

    assert gate_up(first) is gate_up(second) and first.model.lm_head_packed is second.model.lm_head_packed
    assert copy.deepcopy(gate_up(first)) is gate_up(first)  # a model view of a packed model shares it too
    plain = new_llm(**options, kernel_options="matmul=torch").llm_engine.runner
    assert gate_up(plain) is None
