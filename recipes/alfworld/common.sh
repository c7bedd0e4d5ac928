# ALFWorld settings shared by its BPO / GRPO / RLOO recipes; the run scripts source this file.
# Data: python -m verl_bpo.data.prepare alfworld --out "$DATA_DIR" (games from $ALFWORLD_DATA; recipes/README.md).
BENCHMARK=alfworld
# 16 games per step x rollout.n=8 leaves = 128 trajectories per step.
TRAIN_BATCH_SIZE=16
MAX_PROMPT_LENGTH=2048
# 50 turns of <= 256 tokens plus observations that list the admissible commands; prompt + response stays within
# Qwen2.5-7B-Instruct's 32k context. Paths that run out are cut (reward 0, like ALFWorld's own step limit).
MAX_RESPONSE_LENGTH=24576
# ALFWorld's usual budget, and the sandbox's max_steps in the prepared rows.
MAX_TURNS=50
MAX_TOKENS_PER_TURN=256
# A reset loads a game into the planner (seconds on full-size scenes); steps and restores take milliseconds.
STEP_TIMEOUT_S=120
# 26k-token sequences: split each across 2 GPUs (Ulysses) to keep activations well inside 80 GB.
SP_SIZE=2
TOTAL_STEPS=200
TEST_FREQ=10
SAVE_FREQ=50
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
