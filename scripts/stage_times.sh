# Stage timing for the test scripts (sourced): stage_start, then stage_end NAME prints the
# stage's wall time and keeps it for stage_summary TITLE, which prints every stage and the
# script's total.
STAGE_TIMES=()
stage_start() { STAGE_STARTED=$SECONDS; }
stage_end() {
  local took=$((SECONDS - STAGE_STARTED))
  STAGE_TIMES+=("$(printf '%5d s  %s' "$took" "$1")")
  echo "=== $1: ${took} s"
}
stage_summary() {
  echo "=== $1: stage times"
  printf '%s\n' "${STAGE_TIMES[@]}"
  printf '%5d s  %s\n' "$SECONDS" "$1, in all"
}
