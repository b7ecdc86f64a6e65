#!/usr/bin/env bash
# Creates benchmarks/.venv-torchserve with TorchServe 0.12.0 (the comparison baseline of
# benchmarks/compare.py). torch comes from the local CPU wheel pinned in constraints.txt;
# TorchServe's frontend needs a JDK 17 (`java -version`). Idempotent: re-running reinstalls nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/benchmarks/.venv-torchserve"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" \
  torch==2.13.0 torchserve==0.12.0 torch-model-archiver==0.12.0 \
  "grpcio>=1.60" "protobuf>=4" psutil pyyaml
"$VENV/bin/torchserve" --help >/dev/null
echo "TorchServe venv ready: $VENV"
