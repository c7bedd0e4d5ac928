#!/usr/bin/env bash
# ALFWorld, Qwen2.5-7B-Instruct. BPO: one tree of 8 leaves per task, forks of K=2.
# Assumes one node of 8x H100 80GB (recipes/common.sh).
# Matched compute with run_grpo_qwen2.5-7b.sh and run_rloo_qwen2.5-7b.sh: same leaves per task, batch, steps and
# lengths; only algorithm.adv_estimator differs. Extra hydra overrides: "$@". Data, metrics: recipes/README.md.
set -euo pipefail
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-7B-Instruct}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bpo_recipe bpo qwen2.5-7b "$@"
