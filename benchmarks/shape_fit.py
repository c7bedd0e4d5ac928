"""Which one-parameter correction of the allocation model fits the tree shapes measured at a warm start, and what
the corrected model says any shape could do there: a diagnostic (no gradient draws; about a minute on two cores).

``gradient_draws.py`` measured three shapes at ``hard_late``'s warm start 0, gradient variance × generated tokens
against RLOO's: the learned shape (4 root paths, each forked into 5 at the door) 0.78, 2 root paths forked into 4
0.89, 4 forked into 2 0.98, where the allocation model (:mod:`verl_bpo.core.shape`) priced them 0.47, 0.66 and
0.89: the right order, a fifth to two-fifths of each predicted gain. This fits two corrections of the model, each
with one parameter, to those measurements (least squares of the log ratios, each weighted by its CI95: σ = the
CI95's width in log / 3.92), and asks each corrected model what the best shape would measure:

* ``root``: a share b of RLOO's gradient noise behaves as if the root injected it and every turn carried it:
  forks below the root neither average it nor take it out with their siblings' baselines, so K_0 root paths
  carry (N − 1)/(K_0 − 1) of RLOO's. A shape's variance against RLOO's is (1 − b) × the model's + b × that.
* ``walk``: the walk's turns (the depths above the door) inject return variance D_w in all, evenly over them,
  beyond what the profile credits them (what its fitted variogram falls by across them: nothing at this warm
  start); added to the profile and priced by the model unchanged. The trees' returns measure what D_w stands
  for before any fit (``walk_injected_measured``: S_0 γ_0 − S_d γ_d, the return variogram at the root less at the
  door d, with its SE), so this correction can be checked against them. ``--walk-mass M`` prices the walk's turns
  at M × the model's gradient mass for this correction: the model takes each token's score as independent, and
  routine walk tokens that share one score weigh more, so less return variance would do the same.

For each: its parameter with a CI95 (the values within 3.84 of the least weighted squared error), its figure for
each shape, the fit's weighted squared error, and ``best``: the least variance × tokens against RLOO's among the
candidate shapes the learned allocation searches, within RLOO's tokens (``widths``: that shape), to set against the
target 0.5: under that model no shape the allocation can pick does better; ``best_at_ci95_low`` the same at the
lower end of the parameter's CI95, the least correction the measurements allow. The uncorrected model's figures come
too (``model``; its ``best`` minimises per token, where the allocation minimises the variance within the budget, so
the two shapes may differ at like figures). One parameter fitted to three measurements: a fit that lands every shape
within its CI95 is consistent with them, not shown to be the cause; the two corrections stand for where the missing
noise could sit (at the root; on the walk).

    python benchmarks/shape_fit.py [--fixed-shapes docs/results/gradient_draws_hard_late_fixed_shapes.json]
        [--learned docs/results/gradient_draws_hard_late_1024_waves.json] [--walk-mass 1] [--out runs/learning]

The depth profile is taught as ``gradient_draws.py``'s predictions are (its warm-up and 32 batches of BPO's trees
at warm start 0, seed 0): on the kind of machine that made the records it gives their ``predicted_*`` figures,
which the output repeats beside its own (``model``) for the check.

Last line: one JSON object: ``task``, ``measured`` (per shape: ratio and CI95), ``widths`` per shape, ``model``,
per correction (``root``, ``walk``) its ``value`` and ``ci95``, ``predicted`` per shape, ``error``,
``within_ci95`` (every shape's figure inside its CI95), ``best`` and ``best_at_ci95_low`` (``over_rloo``,
``widths``); the model's own ``best``;
``walk_injected_measured``; the records' ``recorded_predictions``; ``walk_mass``, ``target`` and ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from gradient_draws import Profile, cost_over_flat, door_depth, fixed_widths, learned_plan, variance_over_flat

from verl_bpo.core.profile import DepthProfile
from verl_bpo.core.shape import shape_cost
from verl_bpo.demo.tasks import TASKS, task_model

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
TARGET = 0.5
GRIDS = {"root": np.linspace(0.0, 0.5, 501), "walk": np.linspace(0.0, 0.3, 601)}  # b; D_w


def over_rloo(widths: np.ndarray, profile: Profile, flat: np.ndarray, door: int, correction: str | None = None,
              value: float = 0.0) -> np.ndarray:
    """Variance × generated tokens of each row of ``widths`` ``(M, T)`` against ``flat``'s (RLOO: N root paths),
    under the model with ``correction`` (module docstring) at ``value``; ``door``: the depth of the door."""
    if correction == "walk":
        injected = profile.credited.copy()
        injected[:door] += value / door
        profile = profile._replace(credited=injected)
    variance = variance_over_flat(widths, profile, flat)
    if correction == "root":
        variance = (1 - value) * variance + value * (flat[0] - 1) / (widths[:, 0] - 1)
    return variance * cost_over_flat(widths, profile, flat)


def fit(correction: str, measured: dict[str, tuple[float, float, float]], widths: dict[str, np.ndarray],
        profile: Profile, flat: np.ndarray, door: int, grid: np.ndarray) -> dict:
    """The value of ``correction`` on ``grid`` that fits ``measured`` (per shape: ratio, CI95 low, high) best, with
    its CI95: the values whose weighted squared error is within 3.84 of the least (one parameter, the log ratios
    taken as normal); an end at the grid's edge means the grid cut it."""
    names = list(measured)
    rows = np.stack([widths[n] for n in names])
    log_measured = np.log([measured[n][0] for n in names])
    sigma = np.array([np.log(measured[n][2] / measured[n][1]) / 3.92 for n in names])
    predicted = np.stack([over_rloo(rows, profile, flat, door, correction, v) for v in grid])  # (grid, shapes)
    errors = (((np.log(predicted) - log_measured) / sigma) ** 2).sum(axis=1)
    i = int(np.argmin(errors))
    inside = all(measured[n][1] <= predicted[i, j] <= measured[n][2] for j, n in enumerate(names))
    allowed = grid[errors <= errors[i] + 3.84]
    return {"value": round(float(grid[i]), 4), "ci95": [round(float(allowed.min()), 4), round(float(allowed.max()), 4)],
            "predicted": {n: round(float(predicted[i, j]), 3) for j, n in enumerate(names)},
            "error": round(float(errors[i]), 3), "within_ci95": inside}


def best(candidates: np.ndarray, profile: Profile, flat: np.ndarray, door: int, correction: str | None = None,
         value: float = 0.0) -> dict:
    """The candidate of least variance × tokens against RLOO's, among those within RLOO's tokens."""
    cost = shape_cost(candidates, profile.per_sample)
    fits = candidates[cost <= shape_cost(flat[None], profile.per_sample)[0] * (1 + 1e-9)]
    ratios = over_rloo(fits, profile, flat, door, correction, value)
    i = int(np.argmin(ratios))
    return {"over_rloo": round(float(ratios[i]), 3), "widths": fits[i].tolist()}


def walk_injected(profile: DepthProfile, door: int) -> dict:
    """The return variance the walk injects as the profile's trees measured it, before its fit: S_0 γ_0 − S_d γ_d
    (d the door), and the trees behind each term: what the ``walk`` correction's D_w stands against. ``se`` takes
    the two terms as independent, though some trees measure both (an approximation)."""
    mean, spread, trees = profile.variogram()
    spread = np.maximum(spread, 0.0)  # a mean of squares less a squared mean can round below zero
    s = profile.survival
    value = s[0] * mean[0] - s[door] * mean[door]
    se = np.sqrt(sum(s[j] ** 2 * spread[j] / trees[j] for j in (0, door) if trees[j] > 0))
    return {"value": round(float(value), 4), "se": round(float(se), 4),
            "trees": [round(float(trees[j]), 1) for j in (0, door)]}


def measurements(fixed_record: Path, learned_record: Path) -> tuple[str, dict, dict[str, tuple[int, int]], dict]:
    """The task, each shape's measured ratio with its CI95 (``learned`` and the fixed shapes), the fixed shapes'
    (root paths, width), and the records' model predictions."""
    fixed, learned = (json.loads(p.read_text())["result"] for p in (fixed_record, learned_record))
    if fixed["task"] != learned["task"]:
        raise SystemExit(f"--fixed-shapes is of task {fixed['task']}, --learned of {learned['task']}: give one task's")
    measured = {"learned": (learned["grad_var_bpo_over_rloo"], *learned["grad_var_ci95"])}
    shapes, recorded = {}, {"learned": fixed["predicted_learned_over_rloo"]}
    for name, spec in fixed["sets"].items():
        if "shape" in spec:
            shapes[name] = tuple(spec["shape"])
            measured[name] = (fixed[f"grad_var_{name}_over_rloo"], *fixed[f"grad_var_{name}_over_rloo_ci95"])
            recorded[name] = fixed[f"predicted_{name}_over_rloo"]
    if not shapes:
        raise SystemExit(f"--fixed-shapes {fixed_record}: no fixed-shape set in it (gradient_draws.py --sets ... "
                         "BPO_r4k2 BPO_r2k4)")
    return fixed["task"], measured, shapes, recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed-shapes", type=Path, default=RESULTS / "gradient_draws_hard_late_fixed_shapes.json",
                        help="a recorded gradient_draws.py run with fixed-shape sets")
    parser.add_argument("--learned", type=Path, default=RESULTS / "gradient_draws_hard_late_1024_waves.json",
                        help="a recorded gradient_draws.py run with the learned set BPO, of the same task")
    parser.add_argument("--walk-mass", type=float, default=1.0,
                        help="the walk correction prices the walk's turns at this multiple of the model's gradient "
                             "mass (e.g. 8: as if its routine tokens shared one score)")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"), help="where the warm start is cached")
    args = parser.parse_args()
    t0 = time.monotonic()
    name, measured, shapes, recorded = measurements(args.fixed_shapes, args.learned)
    task = TASKS[name]
    plan, depth_profile = learned_plan(task_model(args.out, task), task)
    profile = Profile.of(depth_profile)
    flat, door = fixed_widths(task, plan.rollout_n), door_depth(task)
    widths = {"learned": plan.shape.widths, **{n: fixed_widths(task, *s) for n, s in shapes.items()}}
    model = {n: round(float(over_rloo(w[None], profile, flat, door)[0]), 3) for n, w in widths.items()}
    out = {"task": name, "measured": measured, "widths": {n: w.tolist() for n, w in widths.items()},
           "model": {"predicted": model, "best": best(plan.candidates, profile, flat, door)},
           "recorded_predictions": recorded}
    out["walk_injected_measured"] = walk_injected(depth_profile, door)
    walk_mass = profile.mass.copy()
    walk_mass[:door] *= args.walk_mass
    priced = {"root": profile, "walk": profile._replace(mass=walk_mass)}
    for correction, grid in GRIDS.items():
        result = fit(correction, measured, widths, priced[correction], flat, door, grid)
        result["best"] = best(plan.candidates, priced[correction], flat, door, correction, result["value"])
        # the least correction the measurements allow: the best shape at its most favourable to a tree
        result["best_at_ci95_low"] = best(plan.candidates, priced[correction], flat, door, correction,
                                          result["ci95"][0])
        out[correction] = result
        print(correction, result)
    print(json.dumps({**out, "walk_mass": args.walk_mass, "target": TARGET, "wall_s": round(time.monotonic() - t0)}))


if __name__ == "__main__":
    main()
