#!/usr/bin/env bash
# Portability checks (run by scripts/test.sh beside the suites, which run at the CPU kernel
# level torch detects and against the newest versions installed):
# 1. the exactness tests with torch's CPU kernels capped at each lower level
#    (ATEN_CPU_CAPABILITY=default, avx2), oneDNN's with them (ONEDNN_MAX_CPU_ISA=SSE41,
#    AVX2: the small-row kernels of decode and verify steps) and MKL on another code path
#    (MKL_CBWR=AVX2, COMPATIBLE: MKL chooses its code by CPU vendor and instruction set, and
#    its products of few rows round another way on some, as on an AMD EPYC; an AMD CPU honours
#    only COMPATIBLE), with the small-row and int8 decode tests (a verify step's tokens must
#    round as one-token steps), so exact paths hold on any x86 CPU;
# 2. the lowest versions of transformers, langchain-core and llama-index-core the packages
#    admit (scripts/lowest_versions.py installs them into .venv-lowest, put first on
#    PYTHONPATH): the avx2 run of 1. runs against them (one run checks both: the kernel level
#    and the versions are apart from each other, and the default level's run and the suites
#    keep the newest versions), then the integrations' fast tests.
set -uo pipefail
unset PYTHONDONTWRITEBYTECODE  # as scripts/test.sh: compile each module once, not in every process
cd "$(dirname "$0")/.."
PY="$PWD/.venv/bin/python"
EXACTNESS=(tests/test_exactness.py tests/test_low_precision.py)
# Not repeated at the lower levels: the 16-bit repairs at ratio 1.0 (36 tests, half of these
# runs' time), checked within 1-5% of the largest logit, which no kernel's rounding can cross;
# their float32 form (test_exactness.py, within float32 rounding) and the 16-bit prefix hits
# run at every level.
NOT_REPEATED=(--deselect tests/test_low_precision.py::test_cacheblend_full_ratio_same_greedy_tokens_in_16bit)
# Workers as scripts/test.sh sets them (one per core, at most 4) when run alone.
PARALLEL=(-n "${KVBOOST_RAG_TEST_WORKERS:-$("$PY" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}" --dist loadfile)
source scripts/stage_times.sh
status=0

echo "=== lowest admitted versions"
LOWEST="$PWD/.venv-lowest"
stage_start
lowest=true
if "$PY" scripts/lowest_versions.py "$LOWEST"; then
  stage_end "lowest versions: install"
  PYTHONPATH="$LOWEST${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m kvboost_rag.dev.environment | grep -E '^(transformers|tokenizers|langchain-core|llama-index-core):'
else
  echo "could not install the lowest admitted versions" >&2
  status=1
  lowest=false
fi

# The int8 decode kernels need a vectorized level (their tests skip at the lowest), so the
# int8 tests run at avx2, beside MKL's COMPATIBLE path; MKL's AVX2 path (an Intel CPU's
# nearest to an AMD one's) runs the small-row attention's bitwise checks at the lowest level.
for level in default:SSE41:AVX2:: avx2:AVX2:COMPATIBLE:tests/test_int8_decode.py:lowest; do
  IFS=: read -r aten onednn mkl int8 versions <<<"$level"
  path="${PYTHONPATH:-}"
  if [ "$versions" = lowest ] && $lowest; then
    path="$LOWEST${PYTHONPATH:+:$PYTHONPATH}"
  else
    versions=newest
  fi
  echo "=== exactness tests, ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=$onednn MKL_CBWR=$mkl, $versions versions"
  stage_start
  ATEN_CPU_CAPABILITY=$aten "$PY" -c "import torch; print('torch cpu capability:', torch.backends.cpu.get_cpu_capability())"
  PYTHONPATH="$path" ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=$onednn MKL_CBWR=$mkl "$PY" -m pytest "${PARALLEL[@]}" -q -p no:warnings \
    "${EXACTNESS[@]}" "${NOT_REPEATED[@]}" tests/test_small_rows.py $int8 || status=1
  stage_end "exactness at $aten, $versions versions"
done

if $lowest; then
  stage_start
  export PYTHONPATH="$LOWEST${PYTHONPATH:+:$PYTHONPATH}"
  (cd integrations/langchain-kvboost && "$PY" -m pytest "${PARALLEL[@]}" -q -p no:warnings -m "not slow" tests/unit_tests) || status=1
  (cd integrations/llama-index-llms-kvboost && "$PY" -m pytest "${PARALLEL[@]}" -q -p no:warnings -m "not slow") || status=1
  stage_end "lowest versions: the integrations' fast tests"
fi
stage_summary scripts/test_portability.sh
exit $status
