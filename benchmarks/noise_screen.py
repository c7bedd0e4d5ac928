"""Screen a learning task for noise-limited progress before its control is trained: a prediction, not a verdict.

The learning benchmark qualifies a task when RLOO with 2N rollouts (half RLOO's gradient variance) reaches the
target in <= 0.75x RLOO's updates (``benchmarks/learning.py``). Training that control takes 20-40 minutes per
setting on two cores. This predicts its ratio in a few minutes, so only promising settings are trained.

It draws ``--draws`` real batch gradients of RLOO (N rollouts per task) and of RLOO-2N at the warm-start policy, on
the learning benchmark's trainer and task (a fresh task batch and tree seed per draw, as training sees them), and
replays AdamW on them with the weights frozen at the warm start: each simulated update draws one measured batch
gradient (with replacement), clips it as the trainer does, and takes torch's AdamW step (betas 0.9, 0.999, each
``--adam-eps`` (default: the benchmark's) and the task's learning rate; weight decay left out). Progress after t
updates is the first-order gain in expected return, −ḡ·Δθ, with ḡ the mean gradient estimated from the *other* half
of both estimators' draws (cross-fit, so a draw never grades its own step; one yardstick for both, so its own error
does not favour either). The predicted ratio is the updates RLOO-2N needs to reach the progress RLOO reaches after T
updates, over T, for several T.

What it leaves out, and so why it is a screen: the policy moves during training, and as success rises the gradient's
signal grows (the task becomes step-bound), so the warm start's ratio is a lower bound on a run's; collapses (a
step that breaks the warm start) do not show. ``--after-updates K`` screens at the weights a seed's RLOO run has
after K updates (trained at the benchmark's eps) instead, to see how the ratio moves as training raises success.
``benchmarks/adam_noise_floor.py`` gives the Gaussian model's floor (1/sqrt(2) = 0.707). A task is still qualified
only by its trained control.

Why eps matters: the first-order progress is linear in the learning rate, so the predicted ratio does not depend on
it, but it does depend on AdamW's eps. Where eps is small against the per-weight gradient, Adam divides the noise
out and halving it can save up to 1 - 1/sqrt(2) of the updates; where eps dominates, AdamW is SGD with momentum, whose
expected step does not depend on the noise, and the predicted ratio goes to 1. The drawn gradients do not depend on
eps, so one screen replays several (``--adam-eps 1e-8 1e-5 1e-4``).

    python benchmarks/noise_screen.py --task hard_late [--batch 1] [--lr 7e-4] [--draws 96] [--seed 0] [--after-updates 0]
                                      [--doors 16] [--invalid-penalty 0] [--max-steps 16] [--adam-eps 1e-5 ...]

Last line: one JSON object: ``ratio_by_updates`` (T -> predicted RLOO-2N/RLOO updates), the same from each half of
the draws alone (``ratio_by_updates_per_half``: their spread shows the screen's own noise), both for the first
``--adam-eps``, and ``by_adam_eps`` (eps -> both, for every ``--adam-eps``), ``per_weight_gradient_rms`` (the
RLOO draws' root mean square per weight, to set eps against), ``snr_rloo`` and
``snr_rloo_2n`` (‖E ĝ‖² / tr Cov ĝ), ``success_rloo`` (the mean success of RLOO's drawn batches), the settings,
and ``wall_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from learning import ADAM_EPS, ROLLOUT_N, gram_matrix, signal_to_noise, task_order, trainer, update_batch

from verl_bpo.demo.tasks import TASKS, task_model

BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0  # verl's actor.grad_clip, as LocalRL clips


def draw_gradients(model_dir: Path, task, rollout_n: int, draws: int, lr: float, seed: int
                   ) -> tuple[np.ndarray, float]:
    """``draws`` RLOO batch gradients (of the loss: descent direction is minus) at ``model_dir``'s weights, one row
    each, and the mean success of the batches drawn; ``seed`` picks the task order and the trees' seeds, as a
    learning seed does."""
    rl = trainer(model_dir, task, "rloo", seed, {}, ADAM_EPS, lr, rollout_n)
    order = task_order(task, seed)
    rows, success = [], []
    for d in range(draws):
        rl.updates = d  # a fresh tree seed per draw; the weights never change
        results = rl.rollout(update_batch(order, d, task.batch))
        rl.gradient(results)
        rows.append(rl.flat_gradient().astype(np.float32))
        success.extend(r.metrics["bpo/success_rate"] for r in results)
    return np.stack(rows), float(np.mean(success))


def trained_weights(model_dir: Path, task, updates: int, lr: float, seed: int, out: Path) -> Path:
    """The weights after ``updates`` RLOO updates from the warm start (seed ``seed``'s tasks, as its learning run
    trains), saved with the tokenizer under ``out``: where the screen looks later in a run."""
    import shutil

    target = out / f"{task.name}-rloo-b{task.batch}-lr{lr:g}-s{seed}-u{updates}"
    if not (target / "config.json").exists():
        rl = trainer(model_dir, task, "rloo", seed, {}, ADAM_EPS, lr, ROLLOUT_N)
        order = task_order(task, seed)
        for u in range(updates):
            rl.step(update_batch(order, u, task.batch))
        shutil.copytree(model_dir, target, dirs_exist_ok=True)
        rl.model.save_pretrained(target)
    return target


def adam_walk(draws: np.ndarray, direction: np.ndarray, updates: int, lr: float, eps: float, sims: int,
              seed: int) -> np.ndarray:
    """The weights' displacement along ``direction``, Δθ·direction, after each of ``updates`` AdamW steps on
    gradients resampled from ``draws`` (clipped as the trainer clips), in ``sims`` independent sequences; shape
    ``(sims, updates)``."""
    rng = np.random.default_rng(seed)
    dim = draws.shape[1]
    m = np.zeros((sims, dim), np.float32)
    v = np.zeros((sims, dim), np.float32)
    delta = np.zeros((sims, dim), np.float32)
    walk = np.empty((sims, updates))
    for t in range(1, updates + 1):
        g = draws[rng.integers(len(draws), size=sims)]
        norm = np.linalg.norm(g, axis=1, keepdims=True)
        g = g * np.minimum(1.0, GRAD_CLIP / np.maximum(norm, 1e-12))
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        delta -= lr * (m / (1 - BETAS[0] ** t)) / (np.sqrt(v / (1 - BETAS[1] ** t)) + eps)
        walk[:, t - 1] = delta @ direction
    return walk


def adam_progress(draws: np.ndarray, mean_grad: np.ndarray, updates: int, lr: float, eps: float, sims: int,
                  seed: int) -> np.ndarray:
    """Mean first-order progress −ḡ·Δθ after each of ``updates`` AdamW steps on gradients resampled from ``draws``,
    over ``sims`` independent sequences (:func:`adam_walk` along ``mean_grad``); shape ``(updates,)``."""
    return -adam_walk(draws, mean_grad, updates, lr, eps, sims, seed).mean(0)


def cross_fit_progress(draws: dict[str, np.ndarray], updates: int, lr: float, eps: float, sims: int
                       ) -> dict[str, np.ndarray]:
    """:func:`adam_progress` of each half of each estimator's draws, shape ``(2, updates)`` per estimator. Half h of
    every estimator is graded by one yardstick: the mean of the *other* half of every estimator's draws (all estimate
    the same gradient), so a draw never grades its own step and the estimators are compared on the same ruler."""
    halves = {name: (g[: len(g) // 2], g[len(g) // 2:]) for name, g in draws.items()}
    yardsticks = [np.concatenate([h[1 - i] for h in halves.values()]).mean(0, dtype=np.float64).astype(np.float32)
                  for i in (0, 1)]
    return {name: np.stack([adam_progress(h[i], yardsticks[i], updates, lr, eps, sims, seed=1 + i) for i in (0, 1)])
            for name, h in halves.items()}


def updates_to_reach(progress: np.ndarray, level: float) -> float:
    """First (linearly interpolated) update count at which ``progress`` reaches ``level``; inf if it never does."""
    above = np.nonzero(progress >= level)[0]
    if not len(above):
        return float("inf")
    i = int(above[0])
    if i == 0:
        return level / progress[0] if progress[0] > 0 else 1.0
    lo, hi = progress[i - 1], progress[i]
    return i + (level - lo) / (hi - lo)


def predicted_ratios(rloo: np.ndarray, control: np.ndarray, horizons: list[int]) -> dict[str, float]:
    """For each T: the control's updates to reach RLOO's progress after T updates, over T."""
    return {str(t): round(updates_to_reach(control, rloo[t - 1]) / t, 4) for t in horizons if t <= len(rloo)}


def variant(task, doors: int | None, invalid_penalty: float | None, max_steps: int | None = None):
    """``task`` with another door count (a tokenizer of its own, ``doors<N>``), invalid-action penalty or episode
    step limit (the turn cap and the warm start's follow it); its name says which (``hard_late_doors16_penalty0``,
    ``..._steps16``), so its warm start is cached apart from the task's."""
    config, name, vocabulary = dict(task.sandbox_config), task.name, task.vocabulary
    turns, warm = task.max_turns, dict(task.warm_start)
    if doors is not None and doors != config.get("doors"):
        config["doors"], name, vocabulary = doors, f"{name}_doors{doors}", f"doors{doors}"
    if invalid_penalty is not None and invalid_penalty != config.get("invalid_penalty"):
        config["invalid_penalty"], name = invalid_penalty, f"{name}_penalty{invalid_penalty:g}"
    if max_steps is not None and max_steps != config.get("max_steps"):
        config["max_steps"], name = max_steps, f"{name}_steps{max_steps}"
        turns = warm["max_turns"] = max_steps
    return dataclasses.replace(task, name=name, sandbox_config=config, vocabulary=vocabulary, max_turns=turns,
                               warm_start=warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="hard_late", choices=list(TASKS))
    parser.add_argument("--batch", type=int, default=None, help="tasks per update (default: the task's)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the task's)")
    parser.add_argument("--draws", type=int, default=96, help="batch gradients per estimator")
    parser.add_argument("--seed", type=int, default=0, help="task order and tree seeds (another seed: how it varies)")
    parser.add_argument("--after-updates", type=int, default=0,
                        help="screen after this many RLOO updates of the seed's run instead of at the warm start")
    parser.add_argument("--doors", type=int, default=None,
                        help="a variant of the task with this many doors (its own tokenizer), e.g. sparser success")
    parser.add_argument("--invalid-penalty", type=float, default=None,
                        help="a variant of the task with this sandbox invalid_penalty (the task's: 0.1)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="a variant of the task with this episode step limit (hard_late's: 11)")
    parser.add_argument("--adam-eps", type=float, nargs="+", default=[ADAM_EPS],
                        help=f"AdamW eps values to replay the same draws with (default: the benchmark's, {ADAM_EPS:g})")
    parser.add_argument("--sims", type=int, default=32, help="simulated AdamW runs per half")
    parser.add_argument("--horizons", type=int, nargs="+", default=[4, 8, 16, 24, 36])
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    args = parser.parse_args()
    start = time.monotonic()
    task = variant(dataclasses.replace(TASKS[args.task], batch=args.batch or TASKS[args.task].batch),
                   args.doors, args.invalid_penalty, args.max_steps)
    lr = args.lr or task.lr
    model_dir = task_model(args.out.resolve(), task)
    if args.after_updates:
        model_dir = trained_weights(model_dir, task, args.after_updates, lr, args.seed, args.out.resolve())
    (rloo, success), (control, _) = (draw_gradients(model_dir, task, n, args.draws, lr, args.seed)
                                     for n in (ROLLOUT_N, 2 * ROLLOUT_N))
    draws = {"rloo": rloo, "rloo_2n": control}
    snr = {name: round(signal_to_noise(gram_matrix(g)), 4) for name, g in draws.items()}
    horizon = 3 * max(args.horizons)  # room for the control to catch up
    by_eps = {}
    for eps in args.adam_eps:
        progress = cross_fit_progress(draws, horizon, lr, eps, args.sims)
        ratios = predicted_ratios(progress["rloo"].mean(0), progress["rloo_2n"].mean(0), args.horizons)
        per_half = [predicted_ratios(progress["rloo"][i], progress["rloo_2n"][i], args.horizons) for i in (0, 1)]
        by_eps[f"{eps:g}"] = {"ratio_by_updates": ratios, "ratio_by_updates_per_half": per_half}
        for t, r in ratios.items():
            print(f"{task.name} batch {task.batch} eps {eps:g}: RLOO's progress after {t:>2} updates, RLOO-2N in "
                  f"{r:.3f}x the updates (halves {per_half[0][t]:.3f}, {per_half[1][t]:.3f})", flush=True)
    first = by_eps[f"{args.adam_eps[0]:g}"]
    print(json.dumps({"task": task.name, "sandbox_config": dict(task.sandbox_config), "batch": task.batch, "lr": lr,
                      "draws": args.draws, "seed": args.seed, "after_updates": args.after_updates,
                      "success_rloo": round(success, 4), "sims": args.sims, "adam_eps": args.adam_eps[0],
                      **first, "by_adam_eps": by_eps,
                      "per_weight_gradient_rms": float(f"{np.sqrt(np.mean(rloo.astype(np.float64) ** 2)):.3g}"),
                      "snr_rloo": snr["rloo"], "snr_rloo_2n": snr["rloo_2n"],
                      "wall_s": round(time.monotonic() - start, 1)}))


if __name__ == "__main__":
    main()
