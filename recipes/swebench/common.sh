# SWE-bench settings shared by its BPO / GRPO / RLOO recipes; the run scripts source this file.
# Data: python -m verl_bpo.data.prepare swebench --backend docker --no-render --out "$DATA_DIR"
#   --train-instances <SWE-bench-schema train set> --val-instances <local copy of SWE-bench Verified (.parquet/.jsonl)>
# Every instance runs in its image (swebench/sweb.eval.x86_64.<id>): each node needs a Docker engine started as
# `dockerd --bridge=none --iptables=false` holding those images (docker load them; nothing is pulled), and root for
# the per-sandbox disk quota. recipes/README.md has the local-checkout alternative.
BENCHMARK=swebench
# 8 issues per step x rollout.n=8 leaves = 64 repository sandboxes (and 64 test-suite gradings) per step.
TRAIN_BATCH_SIZE=8
# Issue texts run to a few thousand tokens; longer ones are filtered out (data.filter_overlong_prompts).
MAX_PROMPT_LENGTH=4096
# prompt + response = 32768, Qwen2.5-7B-Instruct's context: 30 turns with command output cut at 4000 characters.
MAX_RESPONSE_LENGTH=28672
# The sandbox's max_steps in the prepared rows: after 30 actions the diff is graded as if submitted.
MAX_TURNS=30
# Room for a whole-file ```write block.
MAX_TOKENS_PER_TURN=2048
# The submit step grades the patch in a fresh container: extraction, application and the eval script get up to
# 300 s each.
STEP_TIMEOUT_S=1000
# 32k-token sequences: split each across 4 GPUs (Ulysses).
SP_SIZE=4
TOTAL_STEPS=100
TEST_FREQ=20
SAVE_FREQ=20
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
