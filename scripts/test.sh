#!/usr/bin/env bash
# Runs every test suite (engine, LangChain integration, LlamaIndex integration), each in its
# own pytest session with its own settings, then the portability checks
# (scripts/test_portability.sh: the exactness tests at each CPU kernel level and against the
# lowest dependency versions the packages admit). Each suite runs on one pytest-xdist worker per
# core (at most 4; KVBOOST_RAG_TEST_WORKERS overrides, 0 runs in one process), a test file per
# worker so module fixtures are built once. Extra arguments go to every suite's pytest call
# (e.g. -m "not slow"). Prints each stage's time and a summary at the end. Exits non-zero if
# anything fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="$PWD/.venv/bin/python"
export KVBOOST_RAG_TEST_WORKERS="${KVBOOST_RAG_TEST_WORKERS:-$("$PY" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
PARALLEL=(-n "$KVBOOST_RAG_TEST_WORKERS" --dist loadfile)
"$PY" -m kvboost_rag.dev.environment
source scripts/stage_times.sh
status=0
for suite in . integrations/langchain-kvboost integrations/llama-index-llms-kvboost; do
  echo "=== pytest: $suite"
  stage_start
  (cd "$suite" && "$PY" -m pytest "${PARALLEL[@]}" "$@") || status=1
  stage_end "pytest $suite"
done
stage_start
bash scripts/test_portability.sh || status=1
stage_end "portability checks"
stage_summary scripts/test.sh
exit $status
