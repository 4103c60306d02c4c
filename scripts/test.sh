#!/usr/bin/env bash
# Runs every test suite (engine, LangChain integration, LlamaIndex integration), each in its
# own pytest session with its own settings, and the portability checks
# (scripts/test_portability.sh: the exactness tests at each CPU kernel level and against the
# lowest dependency versions the packages admit). The engine's suite runs on one pytest-xdist
# worker per core (at most 4; KVBOOST_RAG_TEST_WORKERS overrides, 0 runs it in one process), a
# test file per worker so module fixtures are built once. Beside it, one more process runs the
# rest one session after another (the integrations, then the portability checks), its output
# kept in a log printed when it ends: the engine's suite alone leaves the cores idle while its
# workers wait on subprocesses, servers and file loads, and sessions run one after another each
# pay their start-up and their slowest file's tail. Extra arguments go to every suite's pytest
# call (e.g. -m "not slow"). Prints each stage's time and a summary at the end. Exits non-zero
# if anything fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="$PWD/.venv/bin/python"
# Python compiles a module once and keeps its bytecode (pytest its assertion-rewritten test and
# plugin modules): with PYTHONDONTWRITEBYTECODE set (as some images set it) each of the
# suites' processes would compile the engine and rewrite pytest's plugins again.
unset PYTHONDONTWRITEBYTECODE
export KVBOOST_RAG_TEST_WORKERS="${KVBOOST_RAG_TEST_WORKERS:-$("$PY" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
"$PY" -m kvboost_rag.dev.environment
source scripts/stage_times.sh
REST_LOG="$(mktemp -t kvboost-rag-tests.XXXXXX)"
trap 'rm -f "$REST_LOG"' EXIT

run_suite() {  # run_suite DIR WORKERS [pytest arguments]: one pytest session in DIR
  local suite=$1 workers=$2
  shift 2
  echo "=== pytest: $suite"
  stage_start
  local status=0
  (cd "$suite" && "$PY" -m pytest -n "$workers" --dist loadfile "$@") || status=1
  stage_end "pytest $suite"
  return $status
}

run_rest() {  # the integrations' suites, then the portability checks, in one process at a time
  local status=0
  run_suite integrations/langchain-kvboost 0 "$@" || status=1
  run_suite integrations/llama-index-llms-kvboost 0 "$@" || status=1
  stage_start
  KVBOOST_RAG_TEST_WORKERS=0 bash scripts/test_portability.sh || status=1
  stage_end "portability checks"
  stage_summary "the integrations and the portability checks"
  return $status
}

status=0
run_rest "$@" >"$REST_LOG" 2>&1 &
rest=$!
run_suite . "$KVBOOST_RAG_TEST_WORKERS" "$@" || status=1
echo "=== waiting for the integrations and the portability checks (running beside it since the start)"
stage_start
wait "$rest" || status=1
stage_end "the rest, after the engine's suite"
echo "=== the integrations and the portability checks: their output"
cat "$REST_LOG"
stage_summary scripts/test.sh
exit $status
