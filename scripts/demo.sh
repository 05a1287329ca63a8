#!/usr/bin/env bash
# The demo: set up, answer a question on the embedded default model, then show a cached system prompt at work.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
prefixkv generate "What is the capital of France?"
python examples/cached_system_prompt.py
