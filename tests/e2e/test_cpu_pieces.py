"""Fast checks of the CPU-run pieces (no Ray, no trainer): platform registration and shims, the vLLM plugin, tiny
model, overrides, the metrics reader and the session cleanup."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.e2e.test_cpu_trainer import _cpu_vllm_missing
from tests.e2e.toy_data import arithmetic_examples, write_verl_dataset
from verl_bpo.demo.tiny_model import build_tiny_model
from verl_bpo.platforms import cpu_launch
from verl_bpo.platforms.vllm_cpu import _keep_live_weight

_PROBE = """
import os, torch, torch.distributed as dist, verl
from verl.plugin.platform import PlatformRegistry
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
get_adv_estimator_fn("bpo")
print("registered", "cpu" in PlatformRegistry.registered_names())
print("shim", getattr(dist.init_process_group, "_verl_bpo_cpu_shim", False))
if os.environ.get("VERL_PLATFORM") == "cpu":
    from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device, get_device_id
    from verl.utils.distributed import initialize_global_process_group_ray
    get_torch_device().empty_cache()
    torch.zeros(1).to(get_device_id())
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    initialize_global_process_group_ray()
    print("device", get_device_name(), get_nccl_backend(), dist.get_backend())
"""


def _probe(platform: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform:
        env["VERL_PLATFORM"] = platform
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # a fresh interpreter that imports verl: tens of seconds on 2 cores
def test_cpu_platform_is_inert_without_verl_platform_cpu():
    assert _probe(None).split("\n")[:2] == ["registered False", "shim False"]


@pytest.mark.slow  # a fresh interpreter that imports verl: tens of seconds on 2 cores
def test_cpu_platform_registers_and_initialises_gloo():
    lines = _probe("cpu").split("\n")
    assert lines[:2] == ["registered True", "shim True"]
    assert "device cpu gloo gloo" in lines


def test_gloo_backend_collapse_only_rewrites_all_gloo_strings():
    from verl_bpo.platforms.cpu import _collapse_gloo_backend

    wrapped = _collapse_gloo_backend(lambda *args, **kwargs: (args, kwargs))
    assert wrapped(backend="cpu:gloo,cpu:gloo") == ((), {"backend": "gloo"})
    assert wrapped("cpu:gloo,cpu:gloo", rank=0) == (("gloo",), {"rank": 0})
    assert wrapped(backend="cpu:gloo,cuda:nccl") == ((), {"backend": "cpu:gloo,cuda:nccl"})
    assert wrapped(backend="gloo") == ((), {"backend": "gloo"})


def test_vllm_shim_keeps_live_2d_weights_and_defers_other_shapes():
    calls = []
    dispatch = _keep_live_weight(lambda layer, remove_weight: calls.append(remove_weight))
    linear = torch.nn.Linear(4, 3)
    weight = linear.weight
    dispatch(linear, remove_weight=True)
    assert linear.weight is weight and linear.cpu_linear is torch.nn.functional.linear and calls == []
    conv = torch.nn.Conv1d(4, 4, 3)
    dispatch(conv, remove_weight=True)
    assert calls == [True]


_VLLM_PROBE = """
import sys
from verl_bpo.platforms import vllm_cpu
vllm_cpu.register()
print("vllm imported", "vllm" in sys.modules)
if "vllm" in sys.modules:
    from vllm.model_executor.layers import utils
    dispatch = utils.dispatch_cpu_unquantized_gemm
    vllm_cpu.register()  # vLLM calls it in every engine and worker process: once must stay once
    print("shim", getattr(dispatch, "_verl_bpo_cpu_shim", False), utils.dispatch_cpu_unquantized_gemm is dispatch,
          getattr(dispatch.__wrapped__, "_verl_bpo_cpu_shim", False))
"""


def _vllm_probe(platform: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform:
        env["VERL_PLATFORM"] = platform
    out = subprocess.run([sys.executable, "-c", _VLLM_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.startswith(("vllm imported", "shim"))]  # not vLLM's logs


@pytest.mark.slow  # a fresh interpreter that imports verl: tens of seconds on 2 cores
def test_vllm_plugin_never_imports_vllm_without_verl_platform_cpu():
    # vLLM calls the hook in each engine process; a GPU user's engines must not pay for or be changed by it.
    assert _vllm_probe(None) == ["vllm imported False"]


@pytest.mark.slow  # a fresh interpreter that imports verl and vLLM
@pytest.mark.skipif(_cpu_vllm_missing() is not None, reason=_cpu_vllm_missing() or "")
def test_vllm_plugin_wraps_the_cpu_gemm_dispatch_once_under_verl_platform_cpu():
    assert _vllm_probe("cpu") == ["vllm imported True", "shim True True False"]


def test_tiny_model_builds_once_and_chats(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    corpus = ["What is 1 plus 2? The answer is 3.", "> open door\nYou see a key."] * 50
    out = build_tiny_model(tmp_path / "m", corpus, seed=3)
    config = AutoConfig.from_pretrained(out)
    assert (config.head_dim, config.hidden_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config.vocab_size == len(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 plus 5?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 7 plus 5?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>"

    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    build_tiny_model(out, corpus, seed=3)
    assert weights.stat().st_mtime_ns == mtime
    build_tiny_model(out, corpus, seed=4)
    assert weights.stat().st_mtime_ns != mtime


def test_cpu_overrides_compose_with_verls_trainer_config(tmp_path):
    from hydra import compose, initialize_config_dir

    import verl

    data = write_verl_dataset(tmp_path / "train.parquet", arithmetic_examples(3))
    overrides = cpu_launch.cpu_overrides("/m", data, data, output_dir=tmp_path, n=4, batch_size=3, steps=5,
                                         reward_fn_path=tmp_path / "r.py", extra=["trainer.save_freq=7"])
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose("ppo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")])
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.data.train_batch_size == 3
    assert cfg.trainer.total_training_steps == 5 and cfg.trainer.save_freq == 7
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units == 1
    assert cfg.ray_kwargs.ray_init.num_gpus == 1
    assert list(cfg.trainer.logger) == ["console", "file"]  # run_trainer reads the metrics from the file logger
    assert cfg.reward.custom_reward_function.path == str(tmp_path / "r.py")
    # the step-cost settings (benchmarks/cpu_step.py measures them)
    assert cfg.actor_rollout_ref.model.use_remove_padding is False
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False
    sampler = cfg.trainer.v1.sampler.custom_sampler
    from verl.utils.import_utils import load_extern_object

    from verl_bpo.platforms.replay_poll import QuickPollReplayBuffer

    assert load_extern_object(sampler.path, sampler.name) is QuickPollReplayBuffer

    import pandas as pd

    row = pd.read_parquet(data).iloc[0]
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["ground_truth"].isdigit()


def test_metrics_are_read_from_verls_file_logger(tmp_path, monkeypatch):
    import numpy as np
    from verl.utils.tracking import Tracking

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracking = Tracking("p", "e", default_backend=["file"])
    tracking.log({"actor/grad_norm": 1.5, "timing_s/gen": np.float64(8.1), "actor/pg_loss": float("nan"),
                  "training/global_step": 1, "note": "text"}, step=1)
    tracking.log({"val-core/toy/reward/mean@2": np.float32(0.25)}, step=1)  # validation: same step, merged
    tracking.log({"actor/grad_norm": 2e-3}, step=2)
    tracking.finish()
    metrics = cpu_launch.read_metrics(path)
    assert sorted(metrics) == [1, 2] and metrics[2] == {"actor/grad_norm": 2e-3}
    step1 = metrics[1]
    assert math.isnan(step1.pop("actor/pg_loss"))
    assert step1 == {"actor/grad_norm": 1.5, "timing_s/gen": 8.1, "training/global_step": 1.0,
                     "val-core/toy/reward/mean@2": 0.25}
    with open(path, "a") as f:
        f.write('{"step": 3, "data": {"actor/gr')  # a run killed mid-line
    assert sorted(cpu_launch.read_metrics(path)) == [1, 2]
    assert cpu_launch.read_metrics(tmp_path / "never_written.jsonl") == {}


@pytest.mark.parametrize("base", [None, {"PATH": "/bin"}])
def test_cpu_env(base):
    env = cpu_launch.cpu_env(base)
    assert env["VERL_PLATFORM"] == "cpu" and env["VERL_ENGINE_DEVICE"] == "cuda" and env["HF_HUB_OFFLINE"] == "1"


def test_cpu_overrides_compose_with_the_bpo_trainer_config(tmp_path):
    from hydra import compose, initialize_config_dir

    import verl_bpo.integration
    from verl_bpo.integration.settings import register_schema

    register_schema()
    overrides = cpu_launch.cpu_overrides("/m", "/d.parquet", "/d.parquet", output_dir=tmp_path, adv_estimator="bpo",
                                         n=4, batch_size=1)
    config_dir = Path(verl_bpo.integration.__file__).parent / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose("bpo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")])
    assert cfg.algorithm.adv_estimator == "bpo" and cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.rollout.enable_sleep_mode is False


def test_kill_session_reaches_orphans_of_the_run_only(tmp_path):
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    # The shell exits at once and leaves an orphan (re-parented to init), like a vLLM engine after its server died.
    run = subprocess.Popen(["sh", "-c", "(sleep 300 &); exit 0"], start_new_session=True)
    run.wait()
    try:
        deadline = time.monotonic() + 30
        while _names(cpu_launch.session_processes(run.pid)) != ["sleep"] and time.monotonic() < deadline:
            time.sleep(0.1)  # the subshell forks, then the child becomes sleep
        orphans = cpu_launch.session_processes(run.pid)
        assert _names(orphans) == ["sleep"] and orphans[0].ppid() != run.pid
        assert cpu_launch.kill_session(run.pid) == 1
        assert cpu_launch.session_processes(run.pid) == []
        assert bystander.poll() is None
    finally:
        cpu_launch.kill_session(run.pid, grace_s=1.0)  # nothing left behind when an assertion failed
        bystander.kill()
        bystander.wait()


def _names(processes: list[psutil.Process]) -> list[str]:
    names = []
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            names.append(proc.name())
    return names


def test_quick_poll_replay_buffer_is_verls_sync_buffer_polling_every_tenth_of_a_second():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from verl_bpo.platforms.replay_poll import QuickPollReplayBuffer

    buffer = QuickPollReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
                                   max_off_policy_strategy="drop", sampler_kwargs={})
    assert isinstance(buffer, ReplayBuffer) and buffer.poll_interval == 0.1
    assert ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
                        max_off_policy_strategy="drop", sampler_kwargs={}).poll_interval == 2.0  # verl's, for contrast
