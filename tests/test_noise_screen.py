"""The noise screen's replay of AdamW (``benchmarks/noise_screen.py``) on synthetic gradient draws, no model.

Two properties the screen's prediction rests on: where every batch gradient is the same (no noise), halving the
variance changes nothing (ratio 1); where per-weight noise dwarfs the signal, halving it saves at most 1/sqrt(2)
of the updates under Adam, and close to that (``benchmarks/adam_noise_floor.py``'s floor).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
screen = pytest.importorskip("noise_screen")

DIM, DRAWS, LR, EPS = 400, 256, 1e-3, 1e-8


def draws(signal: float, noise: float, seed: int) -> np.ndarray:
    """Loss gradients: descent along ``-signal`` in every weight, plus Gaussian noise of std ``noise``."""
    rng = np.random.default_rng(seed)
    return (signal + noise * rng.standard_normal((DRAWS, DIM))).astype(np.float32) * 1e-3


def ratios(rloo: np.ndarray, control: np.ndarray, eps: float = EPS) -> dict[str, float]:
    horizons = [8, 16, 24]
    progress = screen.cross_fit_progress({"rloo": rloo, "control": control}, 3 * max(horizons), LR, eps, sims=16)
    assert all(p.shape == (2, 3 * max(horizons)) for p in progress.values())  # each half's own curve
    return screen.predicted_ratios(progress["rloo"].mean(0), progress["control"].mean(0), horizons)


def test_no_noise_no_saving():
    """Identical draws for both: the control reaches RLOO's progress in exactly RLOO's updates."""
    same = np.tile(draws(1.0, 0.0, 0)[:1], (DRAWS, 1))
    assert all(r == pytest.approx(1.0, abs=1e-3) for r in ratios(same, same).values())


def test_noise_bound_saving_near_the_adam_floor():
    """Per-weight signal 0.3 of the noise (adam_noise_floor: 0.736): half the variance gives 0.68-0.80x the
    updates; the same variance gives about 1x (the negative control, which must not look like a saving). Far
    weaker signals need far more draws than these: the replayed draws' own mean error then acts as signal."""
    noisy = ratios(draws(0.3, 1.0, 1), draws(0.3, 1.0 / np.sqrt(2), 2))
    same = ratios(draws(0.3, 1.0, 1), draws(0.3, 1.0, 3))
    assert all(0.68 <= r <= 0.80 for r in noisy.values()), noisy
    assert all(0.90 <= r <= 1.10 for r in same.values()), same


def test_an_eps_that_dwarfs_the_gradient_leaves_nothing_to_save():
    """The same noise-bound draws (per-weight size about 1e-3) replayed with eps 1.0: AdamW's step is then SGD with
    momentum, linear in the gradient, so half the variance no longer saves updates in expectation (about 1x), while
    at eps 1e-8 it does (the test above). This is why the screen replays each eps the benchmark might train with."""
    sgd_like = ratios(draws(0.3, 1.0, 1), draws(0.3, 1.0 / np.sqrt(2), 2), eps=1.0)
    assert all(0.93 <= r <= 1.07 for r in sgd_like.values()), sgd_like


def test_updates_to_reach_interpolates():
    progress = np.array([1.0, 2.0, 4.0])
    assert screen.updates_to_reach(progress, 3.0) == pytest.approx(2.5)
    assert screen.updates_to_reach(progress, 0.5) == pytest.approx(0.5)
    assert screen.updates_to_reach(progress, 5.0) == float("inf")


def test_a_variant_names_what_it_changes_and_keeps_the_rest():
    from verl_bpo.demo.tasks import TASKS

    task = TASKS["hard_late"]
    assert screen.variant(task, None, None) == task
    assert screen.variant(task, 8, 0.1) == task  # the task's own values: no variant
    sparse = screen.variant(task, 16, 0.0)
    assert sparse.name == "hard_late_doors16_penalty0" and sparse.vocabulary == "doors16"
    assert sparse.sandbox_config == {**task.sandbox_config, "doors": 16, "invalid_penalty": 0.0}
    assert (sparse.train_ids, sparse.eval_ids, sparse.lr, sparse.batch) == (task.train_ids, task.eval_ids, task.lr,
                                                                           task.batch)
    roomy = screen.variant(task, None, None, max_steps=16)
    assert roomy.name == "hard_late_steps16" and roomy.vocabulary == task.vocabulary
    assert roomy.sandbox_config == {**task.sandbox_config, "max_steps": 16}
    assert roomy.max_turns == 16 and roomy.warm_start == {**task.warm_start, "max_turns": 16}
    assert screen.variant(task, None, None, max_steps=11) == task


def test_adam_walk_is_torchs_adamw_and_eps_damps_noise_below_it():
    """The replay's displacement is torch's AdamW step for step (no weight decay, the trainer's clip); on pure noise
    a weight moves by about the learning rate per update whatever the noise's size, unless ``eps`` exceeds it."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(DIM) * 0.2).astype(np.float32)  # norm about 4: the trainer's clip to 1 applies
    direction = rng.standard_normal(DIM).astype(np.float32)
    walk = screen.adam_walk(np.tile(g, (DRAWS, 1)), direction, 5, LR, EPS, sims=1, seed=0)[0]
    weights = torch.zeros(DIM, requires_grad=True)
    optimizer = torch.optim.AdamW([weights], lr=LR, eps=EPS, weight_decay=0.0)
    for t in range(5):
        weights.grad = torch.from_numpy(g.copy())
        torch.nn.utils.clip_grad_norm_([weights], screen.GRAD_CLIP)
        optimizer.step()
        assert float(weights.detach().numpy() @ direction) == pytest.approx(walk[t], rel=1e-4)
    noise = (rng.standard_normal((DRAWS, DIM)) * 1e-6).astype(np.float32)  # mean 0, far below the clip
    unit = np.eye(DIM, dtype=np.float32)[0]  # one weight

    def rms(eps: float) -> float:
        return float(np.sqrt(np.mean(np.square(screen.adam_walk(noise, unit, 24, 1.0, eps, sims=64, seed=1)[:, -1]))))

    assert rms(1e-8) > 1.0  # a random walk of ~lr-sized steps (momentum-correlated)
    assert rms(1e-4) < 0.05 * rms(1e-8)  # eps 100x the noise: the steps shrink about 100x
