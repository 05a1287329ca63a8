#!/usr/bin/env bash
# Two replicas, one shared KV store (examples/shared_kv_tier.py): a redis-server, `prefixkv serve --replicas 2
# --kv-remote`, and a prompt computed on one replica served from the store on the other.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/prefixkv ] || bash scripts/setup.sh
.venv/bin/python examples/shared_kv_tier.py
