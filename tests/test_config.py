"""Hydra composition of the BPO config on top of verl's ppo_trainer, and the checks `verl_bpo.main` runs first."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import verl_bpo
from verl_bpo.config import BPOConfig, sampler_config_from
from verl_bpo.main import AGENT_LOOPS_YAML, prepare_config

CONFIG_DIR = str(Path(verl_bpo.__file__).parent / "config")


def compose_bpo(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="bpo_trainer", overrides=["actor_rollout_ref.rollout.name=vllm", *overrides])


def test_bpo_trainer_composes_over_verls_ppo_trainer():
    cfg = compose_bpo("actor_rollout_ref.rollout.n=8", "bpo.k=4", "bpo.sandbox.name=textworld")
    assert cfg.algorithm.adv_estimator == "bpo"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "bpo_tree"
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"  # verl's own keys are all there
    bpo = prepare_config(cfg)
    assert bpo.k == 4 and bpo.sandbox.name == "textworld"
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(AGENT_LOOPS_YAML)
    sampler = sampler_config_from(cfg.bpo, n_leaves=8, estimator="bpo", response_length=512)
    assert sampler.branching.k == 4 and sampler.branching.root_k == 4 and sampler.response_length == 512


def test_every_bpo_field_is_in_the_yaml_and_the_dataclass():
    cfg = compose_bpo()
    assert BPOConfig.from_config(cfg.bpo) == BPOConfig()  # the yaml defaults are the dataclass defaults


def test_grpo_baseline_gets_flat_groups_under_auto():
    cfg = compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8")
    prepare_config(cfg)
    sampler = sampler_config_from(cfg.bpo, n_leaves=8, estimator="grpo", response_length=64)
    assert sampler.branching.root_k == 8


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor_rollout_ref.rollout.n=1"], "rollout.n=1 is the number of leaves"),
        (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.loss_agg_mode=token-mean"],
         "loss_agg_mode=token-mean reweights"),
        (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"],
         "set it to bpo_tree"),
        (["actor_rollout_ref.rollout.n=4", "bpo.mode=flat"], "use adv_estimator=rloo"),
        (["actor_rollout_ref.rollout.n=4", "+bpo.kk=2"], r"unknown bpo config key\(s\) \['kk'\]"),
        (["actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=bpoo"], "Unknown advantage estimator"),
        (["actor_rollout_ref.rollout.n=4", "bpo.score=vibes"], "bpo.score='vibes' is not valid"),
        (["actor_rollout_ref.rollout.n=4", "bpo.k0=9"], r"bpo.k0=9 must be in \[1, n_leaves=4\]"),
    ],
)
def test_bad_settings_fail_before_anything_starts(overrides, message):
    cfg = compose_bpo(*overrides)
    with pytest.raises(ValueError, match=message):
        prepare_config(cfg)


@pytest.mark.parametrize(
    "argv,exits",
    [
        (["python", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=bpo"], True),
        (["python", "/x/verl/trainer/main_ppo.py", "++algorithm.adv_estimator='bpo'"], True),
        (["python", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo"], False),
        (["python", "-m", "verl_bpo.main", "algorithm.adv_estimator=bpo"], False),
        (["/ray/default_worker.py", "--node-ip-address=1"], False),
    ],
)
def test_stock_launch_guard_only_fires_for_stock_main_ppo_with_bpo(argv, exits):
    from verl_bpo.integration.stock_launch import check_stock_launch

    if exits:
        with pytest.raises(SystemExit, match="python -m verl_bpo.main"):
            check_stock_launch(argv)
    else:
        check_stock_launch(argv)


def test_stock_main_ppo_with_bpo_fails_before_ray_or_models_with_the_fix():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=bpo",
         "actor_rollout_ref.rollout.name=vllm"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode != 0
    assert "python -m verl_bpo.main" in out.stderr
    assert "ray init" not in out.stdout.lower()
