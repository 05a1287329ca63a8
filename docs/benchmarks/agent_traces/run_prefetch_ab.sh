#!/bin/bash
# The engine's read-ahead at pause end, on the model: the four shipped Claude Code sessions replayed closed loop
# (think times x0.02, every request with its session hint) against a fresh bf16 server whose pool (8,192 tokens)
# holds about a third of their working set, with a disk tier behind it; --session-policy session against
# session+prefetch, alternating, two rounds. Each run: the replay's JSON, the server's tier counters from /metrics.
#   bash docs/benchmarks/agent_traces/run_prefetch_ab.sh   (from the repository root; ~20 min on 2 cores)
set -u
OUT=${OUT:-docs/benchmarks/agent_traces/on_model_prefetch_amd_epyc}
PORT=${PORT:-8124}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for policy in session session+prefetch; do
    run="$OUT/${policy/+/_}/r$round"
    tier=$(mktemp -d)
    mkdir -p "$run"
    .venv/bin/prefixkv serve --port "$PORT" --dtype bfloat16 --num-threads 2 --kv-cache-tokens 8192 \
      --session-policy "$policy" --kv-offload-dir "$tier" > "$run/server.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
    .venv/bin/prefixkv bench serve --base-url "http://127.0.0.1:$PORT" --trace docs/data/claude_code --sessions 4 \
      --think-scale 0.02 --sim-kv-cache-tokens 8192 --calibration-rounds 0 --output-dir "$run" > "$run/replay.log" 2>&1
    echo "$(date -u +%T) $policy r$round rc=$?"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^prefixkv:(kv_offload|prefix_cache)' > "$run/metrics.txt"
    kill "$server"
    wait "$server"
    rm -rf "$tier"
  done
done
