"""--kernel-options reaches the runner of a real engine (fp32 default model): a switch forced on, an unknown name
or a path that cannot run here is a ValueError naming it, before the engine serves anything."""

from __future__ import annotations

import pytest


def test_engine_kernel_options(new_llm):
    runner = new_llm(kv_cache_tokens=512, kernel_options="cascade_decodes=1,in_place_decodes=0").llm_engine.runner
    assert runner.options.cascade_decodes and not runner.options.in_place_decodes  # fp32 defaults are the reverse
    with pytest.raises(ValueError, match="no_such_switch"):
        new_llm(kv_cache_tokens=512, kernel_options="no_such_switch=1")
    with pytest.raises(ValueError, match="native_attention"):
        new_llm(kv_cache_tokens=512, kernel_options="native_attention=1")  # bf16 only
