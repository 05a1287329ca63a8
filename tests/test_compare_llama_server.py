"""The llama-server comparison's own logic (scripts/compare_llama_server.py): its command line, its streaming
client against prefixkv's real server, and the table. Nothing here builds or runs llama.cpp or depends on speed.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import compare_llama_server as cls  # noqa: E402

from tests.server.live_server import running_server  # noqa: E402


def test_command_line_refuses_what_it_cannot_compare():
    base = ["--llama-server", "bin", "--gguf-dir", "d"]
    assert cls.parse_args(base).formats == ["bf16", "q4_1", "q8_0"]
    assert cls.parse_args([*base, "--formats", "q4_1"]).formats == ["q4_1"]
    for bad in (["--formats", "q4_k"], ["--rounds", "0"], ["--output-tokens", "1"]):
        with pytest.raises(SystemExit):
            cls.parse_args([*base, *bad])


def test_the_client_counts_a_stream_from_prefixkv_and_the_table_reads_it(new_engine):
    with running_server(new_engine(), served_model_name=cls.SERVED_MODEL_NAME) as (base, _, _):
        run = cls.stream_once(base, list(range(100, 120)), 6)
        with pytest.raises(RuntimeError, match="HTTP 400"):
            cls.stream_once(base, [], 6)  # an empty prompt: the server's 400 is reported, not counted
    assert run["output_tokens"] == 6 and run["chunks"] >= 1
    assert run["decode_tok_s"] == pytest.approx(5 / run["decode_s"])
    record = {
        "prefixkv": {"decode_tok_s": 120.0, "ttft_s": 0.02},
        "llama-server": {"decode_tok_s": 100.0, "ttft_s": 0.03},
        "prefixkv_vs_llama_server": 1.2,
    }
    cls.summarize_floor(record, {"floor_bytes": 200e6}, bandwidth_bytes_s=40e9)
    assert record["floor"]["floor_tok_s"] == pytest.approx(200.0)
    assert record["prefixkv"]["times_floor"] == pytest.approx(200 / 120)
    results = {
        "machine": {"cpu": {"model": "AMD EPYC"}, "family": "amd_epyc"},
        "settings": {"threads": 2},
        "bandwidth_bytes_s": 40e9,
        "formats": {"bf16": record},
    }
    assert "| bf16 | 120.0 | 100.0 | **1.20x** |  | 200 | 1.67x | 2.00x | 20 / 30 ms |" in cls.table(results)


def test_model_flag_reads_the_files_converted_from_the_checkpoint(tmp_path):
    import json

    from prefixkv.model.shapes import SHAPES

    cfg = {**SHAPES["qwen3-0.6b"].hf_config(small=True, vocab_size=49152), "prefixkv_shape": {"name": "qwen3-0.6b"}}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(cfg))
    base = ["--llama-server", "bin", "--gguf-dir", str(tmp_path)]
    default = cls.parse_args(base)
    assert default.model_shape is None and cls.gguf_name(default, "bf16") == "smollm2-bf16.gguf"
    assert cls.prefixkv_model(default, "q4_1") is None
    args = cls.parse_args([*base, "--model", str(ckpt)])
    assert args.model_shape["shape"] == "qwen3-0.6b"
    assert [cls.gguf_name(args, f) for f in cls.FORMATS] == [f"qwen3-0.6b-{f}.gguf" for f in cls.FORMATS]
    # prefixkv: the checkpoint for bf16 and q8_0, the converted Q4_1 file (its own blocks) for q4_1
    assert cls.prefixkv_model(args, "bf16") == cls.prefixkv_model(args, "q8_0") == str(ckpt)
    assert cls.prefixkv_model(args, "q4_1") == str(tmp_path / "qwen3-0.6b-q4_1.gguf")
    argv = cls.prefixkv_server(args, "dense", str(tmp_path / "log"), str(ckpt)).argv
    assert argv[argv.index("--model") + 1] == str(ckpt)
    with pytest.raises(SystemExit):
        cls.parse_args([*base, "--model", str(tmp_path / "missing")])
