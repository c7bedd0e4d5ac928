"""How many updates halving the gradient variance can save under Adam: the floor of the learning benchmark's control.

The learning benchmark qualifies a task when RLOO with 2N rollouts (half RLOO's gradient variance) reaches the target
in <= 0.75x RLOO's updates. Under Adam that ratio has a floor. Adam's step per weight is about m / sqrt(v): where
the batch noise sigma dominates the mean gradient g, sqrt(v) is about sigma and the expected step along g is about
lr * g / sigma, so halving the variance speeds progress by at most sqrt(2) (ratio >= 1/sqrt(2) = 0.707); where the
signal dominates, every step is about lr per weight whatever the noise (ratio 1).

This measures the ratio on the simplest objective with that structure: ``d`` weights, a linear objective whose
gradient is ``snr`` per weight plus unit (or half-variance) Gaussian noise, torch's AdamW update rule (betas 0.9,
0.999, no weight decay), and the updates until the mean weight reaches ``--target``, over seeds. It is a model of
the optimizer, not of any task: it says which per-weight signal-to-noise a task needs for the 0.75 rule to be
reachable at all (a task's batch signal-to-noise ‖E g‖² / tr Cov g is the mean of the squared per-weight values).

    python benchmarks/adam_noise_floor.py [--seeds 40]

Last line: {"ratio_by_snr": {"10.0": .., ...}, "floor": 0.7071}.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def updates_to_target(snr: float, variance: float, *, seed: int, dim: int, lr: float, target: float,
                      max_updates: int) -> int:
    """Adam updates until the mean weight reaches ``target`` (``max_updates`` + 1 if it never does)."""
    rng = np.random.default_rng(seed)
    theta, m, v = np.zeros(dim), np.zeros(dim), np.zeros(dim)
    for t in range(1, max_updates + 1):
        g = snr + np.sqrt(variance) * rng.standard_normal(dim)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        theta += lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        if theta.mean() >= target:
            return t
    return max_updates + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snr", type=float, nargs="+", default=[10.0, 1.0, 0.5, 0.3, 0.2, 0.1, 0.03])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--dim", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=0.5)
    args = parser.parse_args()
    ratios = {}
    for snr in args.snr:
        # enough updates for the noisiest setting to arrive: the expected step is ~ lr * snr / sigma per update
        max_updates = int(20 * args.target / (args.lr * min(snr, 1.0)))
        runs = {var: [updates_to_target(snr, var, seed=s, dim=args.dim, lr=args.lr, target=args.target,
                                        max_updates=max_updates) for s in range(args.seeds)] for var in (1.0, 0.5)}
        if max(max(r) for r in runs.values()) > max_updates:
            raise SystemExit(f"snr {snr}: a run did not reach the target in {max_updates} updates")
        ratios[str(snr)] = round(float(np.mean(runs[0.5]) / np.mean(runs[1.0])), 4)
        print(f"per-weight signal-to-noise {snr:6}: updates {np.mean(runs[1.0]):9.1f} at variance 1, "
              f"{np.mean(runs[0.5]):9.1f} at 0.5, ratio {ratios[str(snr)]:.3f}", flush=True)
    print(json.dumps({"ratio_by_snr": ratios, "floor": round(1 / np.sqrt(2), 4), "seeds": args.seeds,
                      "dim": args.dim, "lr": args.lr}))


if __name__ == "__main__":
    main()
