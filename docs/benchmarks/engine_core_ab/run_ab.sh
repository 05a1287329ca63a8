#!/bin/bash
# A/B: prefixkv at 6701fcb (end of issue 22, checked out in /tmp/ab_old: git worktree add /tmp/ab_old 6701fcb) vs
# this checkout (issue 23), alternating, bf16, 2 threads, same machine; JSON under /tmp/ab/{old,new}/r{1,2}
set -u
REPO=${REPO:-$(pwd)}  # run from the repository root
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then dir=/tmp/ab_old; else dir=$REPO; fi
    for b in "system-prompt --system-tokens 2048 --question-tokens 50 --repeats 2" \
             "shared-prefix --prefix-len 1024 --suffix-len 50 --num-prompts 32 --output-len 32 --repeats 2" \
             "zero-hit --input-len 512 --output-len 32 --num-prompts 32 --repeats 2"; do
      name=${b%% *}
      (cd $dir && $REPO/.venv/bin/python -m prefixkv bench $b --dtype bfloat16 --num-threads 2 \
          --output-dir /tmp/ab/$side/r$round > /tmp/ab/$side.r$round.$name.log 2>&1)
      echo "$(date +%T) $side r$round $name rc=$?"
    done
  done
done
