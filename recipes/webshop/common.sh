# WebShop settings shared by its BPO / GRPO / RLOO recipes; the run scripts source this file.
# Data: python -m verl_bpo.data.prepare webshop --out "$DATA_DIR" (rows carry the engine paths; recipes/README.md).
BENCHMARK=webshop
# 16 instructions per step x rollout.n=8 leaves = 128 trajectories per step.
TRAIN_BATCH_SIZE=16
MAX_PROMPT_LENGTH=2048
# 15 turns of <= 512 generated tokens plus the pages (a results page with its action list is ~500 tokens).
MAX_RESPONSE_LENGTH=12288
# The episode limit the prepared rows give the sandbox (max_steps=15, a purchase usually takes 4-8 actions).
MAX_TURNS=15
MAX_TOKENS_PER_TURN=512
STEP_TIMEOUT_S=60
# 14k-token sequences fit one GPU's activations with gradient checkpointing: no sequence parallelism.
SP_SIZE=1
TOTAL_STEPS=200
TEST_FREQ=10
SAVE_FREQ=50
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
