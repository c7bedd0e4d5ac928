"""Gradient variance of BPO vs RLOO vs GRPO at matched generated turns, on two synthetic regimes.

For each regime (verl_bpo.oracle.mdp: ``late_variance_mdp``, ``early_variance_mdp``) and estimator, grow many
independent trees (flat groups for RLOO/GRPO) of N leaves through the production tree sampler on the tabular
sandbox, compute each tree's policy-gradient estimate ĝ from the production credit, and report

    cost-matched variance = tr Cov(ĝ) × E[generated turns per tree]

i.e. the variance of the gradient averaged over a fixed budget of generated turns (a tree shares its prefixes, so it
costs fewer turns than N independent rollouts). RLOO and BPO are unbiased, so their ratio compares like with like.
GRPO's std scaling changes the gradient's scale, so GRPO ratios use the scale-free relative variance
tr Cov(ĝ) × turns / ‖E ĝ‖².

    python benchmarks/variance.py            # full run (a few minutes on 2 cores)
    python benchmarks/variance.py --quick    # under a minute

Last line: {"late_bpo_over_rloo": .., "late_bpo_over_grpo": .., "early_bpo_over_rloo": ..}. Target: late <= 0.5.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from verl_bpo.core.config import BPOConfig
from verl_bpo.oracle.estimates import mean_turns, sample_trees, tree_gradients
from verl_bpo.oracle.mdp import problem
from verl_bpo.oracle.policy import TabularCodec

N_LEAVES = 16
ESTIMATORS = {
    "bpo": BPOConfig(mode="tree", k0=2, k=8, selector="quantile", score="next_token_entropy", max_turns=8),
    "rloo": BPOConfig(mode="flat", max_turns=8),
    "grpo": BPOConfig(mode="flat", max_turns=8, baseline="mean_incl_self", scale="group_std"),
}
REGIMES = ("late", "early")


def measure(regime: str, estimator: str, n_trees: int, seed: int) -> dict[str, float]:
    mdp, theta = problem(regime)
    config = ESTIMATORS[estimator]
    results = sample_trees(regime, {}, config, N_LEAVES, n_trees, seed=seed)
    trees = [r.leaves for r in results]
    grads = tree_gradients(theta, trees, TabularCodec(mdp), config, mdp.gamma)
    flat = grads.reshape(n_trees, -1)
    turns = mean_turns(trees)
    mean = flat.mean(axis=0)
    trace = float(flat.var(axis=0, ddof=1).sum())
    late_turns = grads[:, 1:].reshape(n_trees, -1)  # decisions at depth >= 1
    return {
        "turns": turns,
        "trace": trace,
        "cost_var": trace * turns,
        "rel_var": trace * turns / float(mean @ mean),
        "depth1_cost_var": float(late_turns.var(axis=0, ddof=1).sum()) * turns,
        "leaves": float(np.mean([len(t) for t in trees])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer trees (under a minute)")
    parser.add_argument("--trees", type=int, default=None, help="trees per (regime, estimator); default 20000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_trees = args.trees or (3000 if args.quick else 20000)

    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"N = {N_LEAVES} leaves per task, {n_trees} trees per cell, seed {args.seed}")
    print(f"{'regime':7s} {'estimator':9s} {'turns':>7s} {'leaves':>6s} {'trCov':>9s} {'trCov*turns':>12s} "
          f"{'relative':>9s} {'depth>=1':>9s} {'secs':>6s}")
    for regime in REGIMES:
        results[regime] = {}
        for estimator in ESTIMATORS:
            start = time.perf_counter()
            r = results[regime][estimator] = measure(regime, estimator, n_trees, args.seed)
            print(f"{regime:7s} {estimator:9s} {r['turns']:7.1f} {r['leaves']:6.2f} {r['trace']:9.4f} "
                  f"{r['cost_var']:12.4f} {r['rel_var']:9.2f} {r['depth1_cost_var']:9.4f} "
                  f"{time.perf_counter() - start:6.1f}", flush=True)

    late, early = results["late"], results["early"]
    summary = {
        "late_bpo_over_rloo": round(late["bpo"]["cost_var"] / late["rloo"]["cost_var"], 4),
        "late_bpo_over_grpo": round(late["bpo"]["rel_var"] / late["grpo"]["rel_var"], 4),
        "early_bpo_over_rloo": round(early["bpo"]["cost_var"] / early["rloo"]["cost_var"], 4),
        "late_depth1_bpo_over_rloo": round(late["bpo"]["depth1_cost_var"] / late["rloo"]["depth1_cost_var"], 4),
        "early_depth1_bpo_over_rloo": round(early["bpo"]["depth1_cost_var"] / early["rloo"]["depth1_cost_var"], 4),
        "trees": n_trees,
        "n_leaves": N_LEAVES,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
