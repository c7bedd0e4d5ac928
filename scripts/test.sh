#!/usr/bin/env bash
# The project's test command (README, CI): the layering contracts, then the tests.
#   bash scripts/test.sh                # everything, full-size Monte-Carlo: what CI runs (45-60 min on 2 cores)
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
export BPO_MC_TREES=${BPO_MC_TREES:-12288}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
# import-linter: core imports no verl/torch/sandbox code, rollout no verl/torch, sandbox_adapters no verl (pyproject).
"$VENV/bin/lint-imports" || { echo "lint-imports: a layering contract is broken (see above)" >&2; exit 1; }
"$PY" -m pytest -q -p no:cacheprovider --durations=25 "${ARGS[@]+"${ARGS[@]}"}"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
