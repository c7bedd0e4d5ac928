#!/usr/bin/env bash
# The project's test command (README, CI): the layering contracts, then every test tier.
#   bash scripts/test.sh                  # all tests (CI runs exactly this)
#   bash scripts/test.sh -m "not slow"    # extra pytest arguments pass through
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python
# Trees per case of the Monte-Carlo unbiasedness tests (tests/test_production_unbiased.py states their power).
export BPO_MC_TREES=${BPO_MC_TREES:-12288}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
# import-linter: core imports no verl/torch/sandbox code, rollout no verl/torch, sandbox_adapters no verl (pyproject).
"$VENV/bin/lint-imports" || { echo "lint-imports: a layering contract is broken (see above)" >&2; exit 1; }
"$PY" -m pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
