#!/usr/bin/env bash
# Runs every test suite (engine, LangChain integration, LlamaIndex integration), each in its
# own pytest session with its own settings. Extra arguments go to every pytest call
# (e.g. -m "not slow"). Exits non-zero if any suite fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="$PWD/.venv/bin/python"
status=0
for suite in . integrations/langchain-kvboost integrations/llama-index-llms-kvboost; do
  echo "=== pytest: $suite"
  (cd "$suite" && "$PY" -m pytest "$@") || status=1
done
exit $status
