"""The CLI as a user runs it: a real process on the default model."""
from __future__ import annotations

import os
import subprocess
import sys


def _run(args, stdin=None):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "prefixkv", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_names_paris():
    proc = _run(["generate", "What is the capital of France?", "--max-tokens", "24"])
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_streams_and_keeps_the_conversation():
    proc = _run(["chat", "--max-tokens", "16", "--show-cache"],
                stdin="What is the capital of France?\nAnd of Italy?\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    cached = [line for line in proc.stderr.splitlines() if line.startswith("[cached prompt tokens")]
    assert len(cached) == 2
    assert not cached[1].startswith("[cached prompt tokens: 0/")  # turn 2 reuses turn 1's KV


def test_bad_option_is_a_clear_error():
    proc = _run(["generate", "hi", "--model", "/no/such/model.gguf"])
    assert proc.returncode == 2
    assert "error:" in proc.stderr


def test_cache_tree_renders_shared_system_prompt():
    proc = _run(["cache-tree", "--max-tokens", "2"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("radix cache:")
    assert "careful assistant" in proc.stdout and "hits=2" in proc.stdout  # the system prompt, hit by 2 of 3
