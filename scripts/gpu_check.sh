#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md), run from the repository root on a GPU machine that has
# Python, torch, numpy, pytest and pytest-xdist but no package registry and no network, with
# the folders scripts/gpu_wheels.sh made (.whl, .gpu-tokenizer) carried along:
#   1. install the wheels into a folder put first on PYTHONPATH (the repository root follows:
#      the package is imported from the checkout, not installed);
#   2. print the versions and the GPU;
#   3. the CUDA tests (pytest -m cuda: every CUDA variant, none may skip);
#   4. the decode table of bench/gpu_bench.py (--decode-only, with GPU_CHECK_DECODE_ARGS) at the
#      Llama-3.1-8B shape at about 8k and 32k prompt tokens: model.generate, the engine's eager
#      decode steps, captured steps (compiled graphs, CUDA graphs) with launches per step, and
#      the engine's own generate on an engine built with captured steps, in one run;
#   5. bench/gpu_bench.py at the Llama-3.1-8B and Qwen2.5-7B shapes in bfloat16 at about 2k,
#      8k and 32k prompt tokens (random weights, the carried tokenizer);
#   6. start-up with default settings (bench/startup_bench.py at the decode table's shape,
#      8k-token requests), twice over one fresh cache folder: a machine that never compiled
#      (the first token must not wait for the compiles), then one that compiled before.
# GPU_CHECK_PARTS picks the parts (default "tests decode bench startup"; install and versions
# always run), so a check too long for one call runs as several.
# Each step has a time limit, and the limits are cut to keep the whole check inside
# GPU_CHECK_BUDGET seconds (default 600: 10 minutes; the tests keep the decode table's and the
# benches' limits for them, the decode table the benches', the first bench 90 s for the second); a
# failed step does not stop the next. Logs go to stdout and to files in $OUT when it is set (at
# most 7 files), else in a temporary folder. Exits non-zero when any step failed.
#
# GPU_CHECK_DEVICE=cpu is a dry run on a machine without a GPU: the same steps, the CUDA
# tests collected (they skip) and the CPU variants of the same tests run in their place, the
# bench at the tiny shape with short prompts. Other settings: PYTHON (default python3),
# GPU_WHEELS_DIR and GPU_TOKENIZER_DIR (as for scripts/gpu_wheels.sh), GPU_CHECK_SITE (where
# the wheels go, default /tmp/site), GPU_CHECK_WORKERS (pytest-xdist workers),
# GPU_CHECK_SHAPES (the TTFT benches' shapes, default "Llama-3.1-8B Qwen2.5-7B"; empty: none),
# GPU_CHECK_DECODE_ARGS (the decode table's columns, default "--captured --engine-captured
# --captured-buckets 1,4,16": each bucket is compiled at load, 45 s at the 8B shape on an H100;
# "--engine-captured --engine-defaults": the engine with every setting at its default, its
# buckets built in the background and waited for), GPU_CHECK_STARTUP_LIMIT (seconds of each
# start-up run, default 300; its compile cache: GPU_CHECK_HOME, default a new folder),
# GPU_CHECK_PREFILL_BUCKETS (the TTFT benches' engine runs its prefill passes captured in these
# token buckets, such as 64,256,1024,4096: each compiled at load; empty by default: eager),
# GPU_CHECK_BUDGET, GPU_CHECK_TEST_LIMIT, GPU_CHECK_DECODE_LIMIT and GPU_CHECK_BENCH_LIMIT
# (seconds: the whole check, the tests, the decode table, each bench; GPU_CHECK_DECODE_LIMIT=0
# leaves the decode table out), GPU_CHECK_PROFILE (rows of a profile of one repair call at the longest
# length, after each bench's table; 0: none).
set -u
cd "$(dirname "$0")/.."

MODE="${GPU_CHECK_DEVICE:-cuda}"
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS_DIR:-.whl}"
TOKENIZER="${GPU_TOKENIZER_DIR:-.gpu-tokenizer}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
if ! compgen -G "$WHEELS/*.whl" >/dev/null || [ ! -f "$TOKENIZER/tokenizer.json" ]; then
  echo "no wheels in $WHEELS or no tokenizer in $TOKENIZER: run scripts/gpu_wheels.sh where PyPI is" \
    "reachable and bring both folders along" >&2
  exit 2
fi

LOGS="${OUT:-$(mktemp -d -t gpu-check-XXXXXX)}"
mkdir -p "$LOGS"
case "$MODE" in
  cuda)
    WORKERS="${GPU_CHECK_WORKERS:-6}"
    BUDGET="${GPU_CHECK_BUDGET:-600}"
    TEST_LIMIT="${GPU_CHECK_TEST_LIMIT:-180}"
    DECODE_LIMIT="${GPU_CHECK_DECODE_LIMIT:-330}"
    BENCH_LIMIT="${GPU_CHECK_BENCH_LIMIT:-90}"
    DECODE_SHAPE=Llama-3.1-8B
    DECODE_LENGTHS=8192,32768
    read -r -a SHAPES <<<"${GPU_CHECK_SHAPES-Llama-3.1-8B Qwen2.5-7B}"  # set and empty: no TTFT bench
    # Qwen2.5-7B's context window is 32768 tokens: its longest prompt leaves room for decoding.
    declare -A LENGTHS=([Llama-3.1-8B]=2048,8192,32768 [Qwen2.5-7B]=2048,8192,32640)
    BENCH_ARGS=(--device cuda --dtype bfloat16 --repeats 2 --decode-tokens 8 --profile "${GPU_CHECK_PROFILE:-0}")
    STARTUP_TOKENS=8192
    STARTUP_ARGS=(--device cuda --dtype bfloat16)
    ;;
  cpu)
    WORKERS="${GPU_CHECK_WORKERS:-$("$PYTHON" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
    BUDGET="${GPU_CHECK_BUDGET:-3600}"
    TEST_LIMIT="${GPU_CHECK_TEST_LIMIT:-600}"
    DECODE_LIMIT="${GPU_CHECK_DECODE_LIMIT:-300}"
    DECODE_SHAPE=tiny
    DECODE_LENGTHS=512,1024
    BENCH_LIMIT="${GPU_CHECK_BENCH_LIMIT:-300}"
    SHAPES=(tiny)
    declare -A LENGTHS=([tiny]=512,1024)
    BENCH_ARGS=(--device cpu --dtype bfloat16 --repeats 1 --decode-tokens 4 --chunk-size 32)
    STARTUP_TOKENS=512
    STARTUP_ARGS=(--device cpu --dtype float32 --captured on)
    ;;
  *)
    echo "GPU_CHECK_DEVICE must be cuda or cpu, got $MODE" >&2
    exit 2
    ;;
esac

read -r -a PARTS <<<"${GPU_CHECK_PARTS:-tests decode bench startup}"
part() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }
part bench || SHAPES=()
part decode || DECODE_LIMIT=0
STARTUP_LIMIT="${GPU_CHECK_STARTUP_LIMIT:-300}"
part startup || STARTUP_LIMIT=0
BENCH_RESERVE=$((${#SHAPES[@]} * BENCH_LIMIT + 2 * STARTUP_LIMIT))  # seconds kept for the later steps
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
SUMMARY=()

# within LIMIT RESERVE: LIMIT, or less so that RESERVE seconds of the budget stay for later steps.
within() {
  local left=$((BUDGET - SECONDS - $2))
  echo $((left < $1 ? (left > 10 ? left : 10) : $1))
}

# step NAME LIMIT LOG COMMAND...: run COMMAND under LIMIT seconds, its output to stdout and LOG.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  echo "=== $name (limit ${limit} s)" | tee -a "$log"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "=== $name: stopped at its limit of ${limit} s" | tee -a "$log"
  SUMMARY+=("$name: exit $rc, $((SECONDS - start)) s")
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

ENV_LOG="$LOGS/environment.log"
step "install wheels" "$(within 60 270)" "$ENV_LOG" \
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl

step "versions and device" "$(within 60 270)" "$ENV_LOG" "$PYTHON" - "$MODE" "$SITE" <<'EOF' || exit 1
import sys
from pathlib import Path

import torch
import transformers

from kvboost_rag.dev.environment import main

mode, site = sys.argv[1], Path(sys.argv[2]).resolve()
main()
print(f"transformers from: {Path(transformers.__file__).parent}")
print(f"torch cuda build: {torch.version.cuda}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"gpu: {props.name}, {props.total_memory / 1024**3:.0f} GiB, compute capability {props.major}.{props.minor}")
if Path(transformers.__file__).resolve().parent.parent != site:
    sys.exit(f"transformers does not come from the carried wheels in {site}")
if mode == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device: the CUDA tests would only skip")
EOF

# The CUDA tests, from the test files that hold CUDA variants (modules that import what this
# machine lacks, a bench's plotting library say, hold none and are left out).
TEST_LOG="$LOGS/cuda-tests.log"
XML="$LOGS/cuda-tests.xml"
PYTEST=("$PYTHON" -m pytest -p no:cacheprovider -q -p no:warnings)
part tests && timeout --kill-after=5 "$(within 60 270)" "${PYTEST[@]}" --collect-only --continue-on-collection-errors -m cuda \
  >"$LOGS/collected.tmp" 2>&1
if part tests; then
mapfile -t FILES < <(grep '::' "$LOGS/collected.tmp" | cut -d: -f1 | sort -u)
COLLECTED=$(grep -c '::' "$LOGS/collected.tmp")
{
  echo "=== CUDA variants collected: $COLLECTED, in ${#FILES[@]} files"
  grep '^ERROR ' "$LOGS/collected.tmp" | sed 's/^/not importable here (no CUDA variants run from it): /'
} | tee -a "$TEST_LOG"
rm -f "$LOGS/collected.tmp"
fi
if part tests; then
step "CUDA tests" "$(within "$TEST_LIMIT" $((DECODE_LIMIT + BENCH_RESERVE)))" "$TEST_LOG" \
  "${PYTEST[@]}" -rfEs -m cuda -n "$WORKERS" --dist load --durations=5 --junitxml="$XML" "${FILES[@]}"
step "CUDA tests: count" 30 "$TEST_LOG" "$PYTHON" - "$XML" "$MODE" "$COLLECTED" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

report, mode, collected = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if not report.exists():
    sys.exit("no test report: the tests did not finish")
suite = ElementTree.parse(report).getroot().find("testsuite")
counts = {name: int(suite.get(name, 0)) for name in ("tests", "failures", "errors", "skipped")}
print(f"CUDA variants ({collected} collected): " + ", ".join(f"{value} {name}" for name, value in counts.items()))
ran = counts["tests"] - counts["skipped"]
if counts["tests"] != collected or collected == 0 or counts["failures"] or counts["errors"]:
    sys.exit(1)
if mode == "cuda" and counts["skipped"]:
    sys.exit("a CUDA variant skipped on a machine with CUDA")
if mode == "cpu" and ran:
    sys.exit("a CUDA variant ran on a machine without CUDA")
EOF
if [ "$MODE" = cpu ]; then
  # No GPU: the CPU variants of the same tests run in their place.
  step "CPU variants of the same tests" "$(within "$TEST_LIMIT" $((DECODE_LIMIT + BENCH_RESERVE)))" "$TEST_LOG" \
    "${PYTEST[@]}" -rfEs -m "not cuda" -k cpu -n "$WORKERS" --dist load "${FILES[@]}"
fi
fi

read -r -a DECODE_ARGS <<<"${GPU_CHECK_DECODE_ARGS:---captured --engine-captured --captured-buckets 1,4,16}"
if [ "$DECODE_LIMIT" -gt 0 ]; then
  # Captured steps against eager decode steps and model.generate, one compile for both lengths.
  step "decode table $DECODE_SHAPE (captured steps)" "$(within "$DECODE_LIMIT" "$BENCH_RESERVE")" \
    "$LOGS/decode-$DECODE_SHAPE.log" "$PYTHON" bench/gpu_bench.py --shape "$DECODE_SHAPE" --lengths "$DECODE_LENGTHS" \
    --tokenizer "$TOKENIZER" --decode-only "${DECODE_ARGS[@]}" "${BENCH_ARGS[@]}" --decode-tokens 64
fi

[ -n "${GPU_CHECK_PREFILL_BUCKETS:-}" ] && BENCH_ARGS+=(--captured-prefill "$GPU_CHECK_PREFILL_BUCKETS")
for i in "${!SHAPES[@]}"; do
  shape=${SHAPES[$i]}
  later=$(((${#SHAPES[@]} - i - 1) * BENCH_LIMIT))
  step "gpu_bench $shape" "$(within "$BENCH_LIMIT" "$later")" "$LOGS/bench-$shape.log" \
    "$PYTHON" bench/gpu_bench.py --shape "$shape" --lengths "${LENGTHS[$shape]}" --tokenizer "$TOKENIZER" "${BENCH_ARGS[@]}"
done

if [ "$STARTUP_LIMIT" -gt 0 ]; then
  # Two processes over one fresh compile cache: never compiled, then compiled before.
  HOME_DIR="${GPU_CHECK_HOME:-$(mktemp -d -t kvboost-home-XXXXXX)}"
  for run in "never compiled" "compiled before"; do
    step "start-up, $run" "$(within "$STARTUP_LIMIT" 0)" "$LOGS/startup.log" \
      env KVBOOST_RAG_HOME="$HOME_DIR" "$PYTHON" bench/startup_bench.py --shape "$DECODE_SHAPE" \
      --tokenizer "$TOKENIZER" --tokens "${STARTUP_TOKENS}" "${STARTUP_ARGS[@]}"
  done
fi

{
  echo "=== summary ($MODE, logs in $LOGS)"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total: $SECONDS s, $([ $status -eq 0 ] && echo passed || echo FAILED)"
} | tee "$LOGS/summary.log"
exit $status
