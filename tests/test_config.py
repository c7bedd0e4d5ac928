"""Hydra composition of the BPO config on top of verl's ppo_trainer, and the checks `verl_bpo.main` runs first."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import verl_bpo.integration
from verl_bpo.core.config import BPOConfig
from verl_bpo.integration.settings import AGENT_LOOPS_YAML, prepare_config, read_bpo_config, register_schema

CONFIG_DIR = str(Path(verl_bpo.integration.__file__).parent / "config")
register_schema()


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
    assert bpo.for_estimator("bpo").root_width(8) == 4


def test_the_bpo_block_is_the_dataclass_schema():
    """The yaml declares no bpo field: hydra takes the block from BPOConfig, defaults and types included."""
    cfg = compose_bpo()
    assert read_bpo_config(cfg.bpo) == BPOConfig()
    assert "bpo:" not in (Path(CONFIG_DIR) / "bpo_trainer.yaml").read_text().split("defaults:")[1].split("\n\n")[1]
    with pytest.raises(Exception, match="kk"):
        compose_bpo("bpo.kk=2")  # the schema is closed: a key it lacks cannot be overridden


def test_readme_table_lists_every_bpo_field_with_its_default():
    import dataclasses
    import re

    readme = (Path(CONFIG_DIR).parents[2] / "README.md").read_text()
    table = readme.split("### The `bpo:` block")[1].split("\n\n")[1]
    documented = {}
    for line in table.splitlines()[2:]:
        names, defaults = line.split("|")[1:3]
        for name, default in zip(re.findall(r"`([a-z0-9_.]+)`", names), re.findall(r"`([^`]+)`", defaults)):
            documented[name] = default
    expected = {f.name: f.default for f in dataclasses.fields(BPOConfig) if f.name != "sandbox"}
    expected.update({"sandbox.name": "smoke", "sandbox.config": "{}"})
    assert set(documented) == set(expected)
    for name, default in expected.items():
        shown = documented[name]
        assert shown == ("null" if default is None else str(default).lower() if isinstance(default, bool)
                         else str(default)), (name, shown, default)


def test_grpo_baseline_gets_flat_groups_under_auto():
    cfg = compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8")
    bpo = prepare_config(cfg)
    assert bpo.for_estimator("grpo").is_flat(8) and bpo.for_estimator("grpo").root_width(8) == 8


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
        (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=True"], "use_kl_in_reward=True"),
        (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.entropy_coeff=0.01"], "entropy_coeff=0.01"),
        (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.loss_scale_factor=null"],
         "loss_scale_factor=null"),
        (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.calculate_log_probs=False"],
         "calculate_log_probs=False"),
        (["actor_rollout_ref.rollout.n=4", "bpo.sandbox.name=nosuch"], r"bpo.sandbox.name='nosuch'"),
        (["actor_rollout_ref.rollout.n=4", "+bpo.sandbox.config.unknown_key=1"], r"unknown key\(s\) \['unknown_key'\]"),
        (["actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=bpoo"], "Unknown advantage estimator"),
        (["actor_rollout_ref.rollout.n=4", "bpo.score=vibes"], "bpo.score='vibes' is not valid"),
        (["actor_rollout_ref.rollout.n=4", "bpo.k0=9"], r"bpo.k0=9 exceeds actor_rollout_ref.rollout.n=4"),
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
