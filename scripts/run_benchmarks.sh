#!/usr/bin/env bash
# Every benchmark at the sizes the issues name, bf16 on 2 threads (the reference's setting); JSON + plots in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT:-bench_results}
COMMON="--dtype bfloat16 --num-threads 2 --output-dir $OUT"
run() { echo "=== prefixkv bench $*"; prefixkv bench "$@"; }
run system-prompt --system-tokens 2048 --question-tokens 50 --repeats 3 $COMMON
run multi-turn --turns 8 --turn-tokens 100 --output-len 32 --repeats 2 $COMMON
run shared-prefix --prefix-len 1024 --suffix-len 50 --num-prompts 32 --output-len 32 --repeats 2 $COMMON
run throughput --input-len 512 --output-len 32 --num-prompts 32 --compare-hf $COMMON
run zero-hit --input-len 512 --output-len 32 --num-prompts 32 --repeats 2 $COMMON
run restart --system-tokens 2048 --question-tokens 50 --repeats 3 $COMMON
run cache-invariance $COMMON
run overflow --pool-tokens 8192 --working-set 4 --system-tokens 1024 --question-tokens 32 --rounds 3 $COMMON
run thrash --output-dir $OUT
run thrash --requests-per-group 24 --on-model --dtype bfloat16 --num-threads 2 --output-dir $OUT/thrash_on_model
run page-size --output-dir $OUT
run schedule-cost --output-dir $OUT
for cache in hash off; do
  port=$((18000 + RANDOM % 1000))
  prefixkv serve --port $port --prefix-cache $cache --dtype bfloat16 --num-threads 2 >/tmp/serve_$cache.log 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  run serve --base-url http://127.0.0.1:$port --workload system-prompt --concurrency 4 --num-requests 16 \
      --system-prompt-tokens 2048 --output-tokens 32 --ignore-eos --output-dir $OUT/serve_$cache
  kill $pid; wait $pid 2>/dev/null
done
