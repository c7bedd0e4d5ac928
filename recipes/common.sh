# Shared launcher of the GPU recipes (sourced, not run). recipes/<benchmark>/common.sh sets the benchmark's values
# and sources this file; each run script then calls `bpo_recipe <estimator> <model tag> "$@"`.
#
# Every setting lives here or in the benchmark's common.sh, never in a run script, so a BPO run and its GRPO/RLOO
# baseline on the same benchmark and model differ only in algorithm.adv_estimator (and the experiment name):
# same rollout.n (leaves per task), batch, steps, turn limit, token budgets, optimizer and KL. Pass any extra
# override to both runs of a comparison, or the compute is no longer matched.
#
# Hardware assumed: one node of 8x NVIDIA H100 80GB (bf16, NVLink), CUDA torch + vLLM installed next to verl 0.9.1.
# Other shapes: NNODES / N_GPUS_PER_NODE, and ROLLOUT_TP (vLLM tensor parallel size) for smaller GPUs.
#
# Environment knobs: MODEL_PATH (set by the run script, overridable), DATA_DIR (where `python -m
# verl_bpo.data.prepare <benchmark> --out DIR` wrote train.parquet/val.parquet), PYTHON (default python3),
# PROJECT_NAME, NNODES, N_GPUS_PER_NODE, ROLLOUT_TP, and VERL_BPO_DRY_RUN=1 to print the command (one argument per
# line, nothing else) instead of running it.

: "${BENCHMARK:?recipes/<benchmark>/common.sh sets BENCHMARK}"
PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-$HOME/data/bpo/$BENCHMARK}
PROJECT_NAME=${PROJECT_NAME:-verl_bpo_$BENCHMARK}
NNODES=${NNODES:-1}
N_GPUS_PER_NODE=${N_GPUS_PER_NODE:-8}
# A 7-8B model in bf16 fits one H100 with room for KV cache; TP=2 still leaves four vLLM replicas on 8 GPUs and
# more cache per replica for the long multi-turn contexts (verl's canonical 7-8B GRPO scripts use 2 as well).
ROLLOUT_TP=${ROLLOUT_TP:-2}

# Leaves per task (GRPO/RLOO group size; BPO tree size) and the fork arity below the root.
N_LEAVES=8
BPO_K=2

bpo_recipe() {
  local estimator=$1 model_tag=$2
  shift 2
  local seq_len=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))
  local args=(
    -m verl_bpo.main
    algorithm.adv_estimator="$estimator"
    # KL to the reference policy as a reward penalty: it reaches every estimator's returns the same way (BPO credits
    # it through the tree); verl's KL loss averages leaf rows with equal weight, which biases it on a tree.
    algorithm.use_kl_in_reward=True
    algorithm.kl_penalty=low_var_kl
    algorithm.kl_ctrl.kl_coef=0.001

    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/val.parquet"
    data.train_batch_size="$TRAIN_BATCH_SIZE"
    data.max_prompt_length="$MAX_PROMPT_LENGTH"
    # The whole multi-turn transcript (all turns and observations) is the response; a path that runs out of it is
    # cut and counted in bpo/truncated_leaves.
    data.max_response_length="$MAX_RESPONSE_LENGTH"
    data.filter_overlong_prompts=True
    data.truncation=error

    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True

    actor_rollout_ref.actor.optim.lr=1e-6
    # One optimizer step per batch (mini batch = the whole batch): the BPO estimate N * w_leaf * A is the
    # on-policy gradient, and the baselines get the same single update so the comparison stays like for like.
    actor_rollout_ref.actor.ppo_mini_batch_size="$TRAIN_BATCH_SIZE"
    # Transcripts vary from a few hundred to tens of thousands of tokens: pack micro batches by tokens.
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((2 * seq_len / SP_SIZE))
    actor_rollout_ref.actor.ulysses_sequence_parallel_size="$SP_SIZE"
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    # seq-mean-token-sum-norm (bpo_trainer.yaml's default, kept for the baselines too) divides by this factor; left
    # unset it is the padded width of each micro batch, which changes with dynamic batching and would rescale
    # rows unevenly. A constant keeps every row's weight exactly 1/batch.
    actor_rollout_ref.actor.loss_scale_factor="$MAX_RESPONSE_LENGTH"
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.ref.fsdp_config.param_offload=True

    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.n="$N_LEAVES"
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    # Siblings of a fork share their whole prefix; prefix caching makes the K children cost one prefill.
    actor_rollout_ref.rollout.enable_prefix_caching=True

    bpo.fixed.k="$BPO_K"
    # Packed trees (each shared token trained once) need Ulysses sequence parallelism off; with SP_SIZE > 1 the
    # actor trains one row per leaf (the same gradient, more trainer tokens).
    bpo.packed="$( [ "$SP_SIZE" -gt 1 ] && echo false || echo true )"
    bpo.max_turns="$MAX_TURNS"
    bpo.max_tokens_per_turn="$MAX_TOKENS_PER_TURN"
    bpo.step_timeout_s="$STEP_TIMEOUT_S"
    # Fallback only: every row of the prepared data names its sandbox and config in extra_info.
    bpo.sandbox.name="$BENCHMARK"

    trainer.critic_warmup=0
    trainer.logger=[console,wandb]
    trainer.project_name="$PROJECT_NAME"
    trainer.experiment_name="${estimator}_${model_tag}_n${N_LEAVES}"
    trainer.n_gpus_per_node="$N_GPUS_PER_NODE"
    trainer.nnodes="$NNODES"
    trainer.total_training_steps="$TOTAL_STEPS"
    # Epochs only bound the loop; total_training_steps decides when training stops.
    trainer.total_epochs=1000
    trainer.save_freq="$SAVE_FREQ"
    trainer.test_freq="$TEST_FREQ"
    trainer.val_before_train=True
    "$@"
  )
  if [[ -n "${VERL_BPO_DRY_RUN:-}" ]]; then
    printf '%s\n' "$PYTHON" "${args[@]}"
    return 0
  fi
  exec "$PYTHON" "${args[@]}"
}
