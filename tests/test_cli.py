"""The CLI: each command in this process on the session's shared weights, and once as the real process."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest


@pytest.fixture
def cli(monkeypatch, new_llm):
    """prefixkv.cli.main, with every LLM it builds running on the shared weights (small pool): the commands'
    logic without a model load per command."""
    import prefixkv.cli
    import prefixkv.llm

    monkeypatch.setattr(prefixkv.llm, "LLM", new_llm)
    if hasattr(prefixkv.cli, "LLM"):  # imported at the top of the module rather than in each command
        monkeypatch.setattr(prefixkv.cli, "LLM", new_llm)
    return prefixkv.cli.main


def test_generate_names_paris():
    """`python -m prefixkv generate` as a user runs it. The timeout only guards against a hang: it takes seconds."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixkv",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "12",
            "--kv-cache-tokens",
            "2048",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_streams_and_keeps_the_conversation(cli, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n\n"))
    assert cli(["chat", "--max-tokens", "16", "--show-cache"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    cached = [line for line in err.splitlines() if line.startswith("[cached prompt tokens")]
    assert len(cached) == 2
    assert not cached[1].startswith("[cached prompt tokens: 0/")  # turn 2 reuses turn 1's KV


def test_bad_option_is_a_clear_error(cli, capsys):
    assert cli(["generate", "hi", "--model", "/no/such/model.gguf"]) == 2
    assert "error:" in capsys.readouterr().err


def test_cache_tree_renders_shared_system_prompt(cli, capsys):
    assert cli(["cache-tree", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("radix cache:")
    assert "careful assistant" in out and "hits=2" in out  # the system prompt, hit by 2 of 3
