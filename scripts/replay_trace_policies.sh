#!/bin/bash
# `prefixkv bench serve --trace` once per schedule policy against a fresh `prefixkv serve` (bf16, 2 threads), then
# `prefixkv simulate` with the fitted CPU cost model on the same slice: docs/benchmarks/conversation_trace/on_model.
# Run from the repository root; OUT (default /tmp/trace_serve) receives the logs and JSON.
set -u
cd "${REPO:-.}"
PY=.venv/bin/python
# TRACE: the whole Mooncake conversation trace (START 1800, the default), or its slice in the repository,
# docs/data/mooncake_1800s_400.jsonl (the same 400 requests: START=0)
TRACE=${TRACE:?set TRACE to the whole Mooncake conversation trace, or to docs/data/mooncake_1800s_400.jsonl with START=0}
START=${START:-1800}
OUT=${OUT:-/tmp/trace_serve}
SLICE="--tokens-per-block 8 --max-requests 400 --time-scale 0.3"
ENGINE="--dtype bfloat16 --num-threads 2 --prefix-cache radix --page-size 8 --kv-cache-tokens 16384 --max-num-seqs 16"
mkdir -p $OUT
port=8123
for policy in ${POLICIES:-fcfs lpm dfs-weight bounded-lpm k-lpm}; do
  $PY -m prefixkv.cli serve --port $port $ENGINE --schedule-policy $policy > $OUT/server_$policy.log 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  $PY -m prefixkv.cli bench serve --base-url http://127.0.0.1:$port --trace $TRACE $SLICE --trace-start $START \
      --bound-page-size 8 --output-dir $OUT/$policy > $OUT/bench_$policy.log 2>&1
  kill $pid; wait $pid 2>/dev/null
  tail -4 $OUT/bench_$policy.log
done
for policy in ${POLICIES:-fcfs lpm dfs-weight bounded-lpm k-lpm}; do
  $PY -m prefixkv.cli simulate --trace $TRACE --tokens-per-block 8 --max-requests 400 --time-scale 0.3 --start-s $START \
      --prefix-cache radix --page-size 8 --kv-cache-tokens 16384 --max-num-seqs 16 --schedule-policy $policy \
      --cost-model smollm2-cpu-2t --output-dir $OUT/sim_$policy --quiet > $OUT/sim_$policy.log 2>&1
done
