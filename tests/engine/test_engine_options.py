"""Engine options are defined once (EngineConfig) and the command line is generated from them, vLLM's names
included. No model is loaded here: these test EngineConfig and the argparse layer."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixkv.config import EngineConfig
from prefixkv.engine_args import add_engine_args, engine_config, engine_kwargs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_every_config_field_has_help_and_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert f"--{f.name.replace('_', '-')}" in flags
    assert {"--lpm-fallback-threshold", "--max-wait-steps", "--seed"} <= flags  # missing before


def test_defaults_are_the_config_defaults():
    assert engine_config(parse([])) == EngineConfig()


def test_flags_reach_the_config():
    config = engine_config(
        parse(
            [
                "--lpm-fallback-threshold",
                "none",
                "--max-wait-steps",
                "7",
                "--seed",
                "3",
                "--schedule-policy",
                "bounded-lpm",
                "--kv-cache-tokens",
                "4096",
            ]
        )
    )
    assert config.lpm_fallback_threshold is None and config.max_wait_steps == 7 and config.seed == 3
    assert config.schedule_policy == "bounded-lpm" and config.kv_cache_tokens == 4096
    assert engine_config(parse(["--seed", "none"])).seed is None
    with pytest.raises(SystemExit):
        parse(["--prefix-cache", "lru"])


def test_block_size_alias():
    assert EngineConfig.from_kwargs(block_size=16).page_size == 16
    assert EngineConfig.from_kwargs(prefix_cache="radix", block_size=4).page_size == 4
    assert engine_config(parse(["--block-size", "32"])).page_size == 32
    assert EngineConfig.from_kwargs(block_size=8, page_size=8).page_size == 8
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_kwargs(block_size=8, page_size=16)


def test_enable_prefix_caching_alias():
    assert EngineConfig.from_kwargs(enable_prefix_caching=False).prefix_cache == "off"
    assert EngineConfig.from_kwargs(enable_prefix_caching=False, prefix_cache="radix").prefix_cache == "off"
    assert EngineConfig.from_kwargs(enable_prefix_caching=True).prefix_cache == "hash"  # the default cache
    assert EngineConfig.from_kwargs(enable_prefix_caching=True, prefix_cache="radix").prefix_cache == "radix"
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig.from_kwargs(enable_prefix_caching=True, prefix_cache="off")
    with pytest.raises(ValueError, match="True or False"):
        EngineConfig.from_kwargs(enable_prefix_caching="no")
    assert engine_config(parse(["--no-enable-prefix-caching"])).prefix_cache == "off"
    assert engine_config(parse(["--prefix-cache", "radix", "--enable-prefix-caching"])).prefix_cache == "radix"
    assert engine_config(parse(["--enable-prefix-caching"])).prefix_cache == "hash"
    with pytest.raises(ValueError, match="contradicts"):
        engine_config(parse(["--prefix-cache", "off", "--enable-prefix-caching"]))


def test_kv_cache_memory_bytes_alias():
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=1 << 20).kv_cache_memory == 1 << 20
    assert engine_config(parse(["--kv-cache-memory-bytes", "4096"])).kv_cache_memory == 4096
    assert engine_kwargs(parse(["--kv-cache-memory", "4096"]))["kv_cache_memory"] == 4096


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_kwargs(gpu_memory_utilization=0.9)


def test_pool_size_from_tokens_or_bytes():
    assert EngineConfig(kv_cache_tokens=4096).kv_cache_pages(bytes_per_token=100) == 4096 // 16
    assert EngineConfig(kv_cache_memory=16 * 100 * 3).kv_cache_pages(bytes_per_token=100) == 3
    assert EngineConfig().kv_cache_pages(bytes_per_token=1 << 10) == (1 << 30) // ((1 << 10) * 16)
    with pytest.raises(ValueError, match="too small"):
        EngineConfig(kv_cache_memory=10).kv_cache_pages(bytes_per_token=100)


def test_kernel_options_parse_and_reach_the_command_line():
    config = engine_config(parse(["--kernel-options", "native_attention=0, cascade_decodes=on"]))
    assert config.kernel_overrides() == {"native_attention": False, "cascade_decodes": True}
    assert EngineConfig().kernel_overrides() == {}
    assert EngineConfig(kernel_options="cache_invariant=0,matmul=onednn").kernel_overrides() == {
        "cache_invariant": False,
        "matmul": "onednn",
    }
    for bad in ("native_attention", "native_attention=maybe", "=1", "matmul=", "matmul=one dnn"):
        with pytest.raises(ValueError, match="kernel_options"):
            EngineConfig(kernel_options=bad)
