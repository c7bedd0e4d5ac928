"""Gradient variance of BPO vs RLOO vs GRPO on two synthetic regimes, at matched generated turns and matched rows.

For each regime (``verl_bpo.oracle.mdp``: ``late`` — most return variance comes from the last decision; ``early``
— the first decision settles the outcome) every estimator grows many trees of N = 16 (flat groups for RLOO/GRPO)
through the production tree sampler on the tabular sandbox, and each tree's gradient estimate ĝ comes from the
production credit. Reported, side by side in one run:

    turns-matched variance = tr Cov(ĝ) × E[generated turns per tree]    (rollout compute; native snapshots)
    rows-matched variance  = tr Cov(ĝ) × E[leaf rows per tree]          (what the trainer pays for every leaf)

i.e. the variance of the gradient averaged over a fixed budget of turns, or of trainer rows. RLOO and BPO are
unbiased and on one scale, so their ratio compares like with like; GRPO's std scaling changes the gradient's scale,
so GRPO ratios use the scale-free tr Cov(ĝ) × turns / ‖E ĝ‖².

BPO here is ``bpo.allocation=learned`` with ``bpo.learned.budget_unit=turns`` (the turns N flat rollouts would take):
``--warmup`` exploration trees first (not counted), then every tree counts, the ``--explore-share`` of later
exploration trees included. The fixed rule (K0 = 2, K = 8, the quantile selector on the next-token entropy, exactly N
leaves) is reported beside it.

    python benchmarks/variance.py            # 20000 trees per cell (about 20 minutes on 2 cores)
    python benchmarks/variance.py --quick    # 3000 trees per cell

Last line: {"late_bpo_over_rloo": .., "early_bpo_over_rloo": .., "late_rows_bpo_over_rloo": ..,
"early_rows_bpo_over_rloo": .., "late_bpo_over_grpo": .., ...}. Targets at matched turns: late <= 0.40,
early <= 1.00.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from verl_bpo.core.config import Ablation, BPOConfig, FixedAllocation, LearnedAllocation
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.oracle.estimates import mean_turns, sample_trees, tree_gradients
from verl_bpo.oracle.mdp import problem
from verl_bpo.oracle.policy import TabularCodec

ROLLOUT_N, HORIZON = 16, 8
REGIMES = ("late", "early")


def configs(warmup: int, explore_share: float) -> dict[str, BPOConfig]:
    return {
        "bpo": BPOConfig(mode="tree", allocation="learned", max_turns=HORIZON,
                         learned=LearnedAllocation(budget_unit="turns", max_leaves=8 * ROLLOUT_N, warmup_trees=warmup,
                                                   explore_share=explore_share)),
        "fixed": BPOConfig(mode="tree", max_turns=HORIZON,
                           fixed=FixedAllocation(k0=2, k=8, selector="quantile", score="next_token_entropy")),
        "flat": BPOConfig(mode="flat", max_turns=HORIZON),
    }


def cell(grads: np.ndarray, turns: float, rows: float) -> dict[str, float]:
    flat = grads.reshape(len(grads), -1)
    mean = flat.mean(axis=0)
    trace = float(flat.var(axis=0, ddof=1).sum())
    return {"turns": turns, "rows": rows, "trace": trace, "turns_var": trace * turns, "rows_var": trace * rows,
            "rel_var": trace * turns / float(mean @ mean)}


def measure(regime: str, name: str, config: BPOConfig, n_trees: int, burn: int, seed: int) -> dict[str, dict]:
    mdp, theta = problem(regime)
    policy = ForkPolicy(config)
    results = sample_trees(regime, {}, config, ROLLOUT_N, burn + n_trees, seed=seed, policy=policy)[burn:]
    trees = [r.leaves for r in results]
    turns, rows = mean_turns(trees), float(np.mean([len(t) for t in trees]))
    codec = TabularCodec(mdp)
    out = {name: cell(tree_gradients(theta, trees, codec, config, mdp.gamma), turns, rows)}
    if name == "flat":  # the same flat groups, credited as RLOO and as GRPO
        grpo = BPOConfig(mode="flat", ablation=Ablation(mean_incl_self=True, group_std=True))
        out = {"rloo": out["flat"], "grpo": cell(tree_gradients(theta, trees, codec, grpo, mdp.gamma), turns, rows)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3000 trees per cell")
    parser.add_argument("--trees", type=int, default=None, help="trees per cell; default 20000")
    parser.add_argument("--warmup", type=int, default=300, help="exploration trees before the profile decides")
    parser.add_argument("--explore-share", type=float, default=0.02, help="share of later exploration trees")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_trees = args.trees or (3000 if args.quick else 20000)

    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"N = {ROLLOUT_N}, horizon {HORIZON}, {n_trees} trees per cell, seed {args.seed}")
    print(f"{'regime':7s} {'estimator':9s} {'turns':>7s} {'rows':>6s} {'trCov':>9s} {'x turns':>9s} {'x rows':>9s} "
          f"{'relative':>9s} {'secs':>6s}")
    for regime in REGIMES:
        results[regime] = {}
        for name, config in configs(args.warmup, args.explore_share).items():
            start = time.perf_counter()
            burn = args.warmup if name == "bpo" else 0
            cells = measure(regime, name, config, n_trees, burn, args.seed)
            for estimator, r in cells.items():
                results[regime][estimator] = r
                print(f"{regime:7s} {estimator:9s} {r['turns']:7.1f} {r['rows']:6.1f} {r['trace']:9.4f} "
                      f"{r['turns_var']:9.3f} {r['rows_var']:9.3f} {r['rel_var']:9.2f} "
                      f"{time.perf_counter() - start:6.1f}", flush=True)

    def ratio(regime: str, a: str, b: str, key: str) -> float:
        return round(results[regime][a][key] / results[regime][b][key], 4)

    summary = {}
    for regime in REGIMES:
        summary[f"{regime}_bpo_over_rloo"] = ratio(regime, "bpo", "rloo", "turns_var")
    for regime in REGIMES:
        summary[f"{regime}_rows_bpo_over_rloo"] = ratio(regime, "bpo", "rloo", "rows_var")
    for regime in REGIMES:
        summary[f"{regime}_bpo_over_grpo"] = ratio(regime, "bpo", "grpo", "rel_var")
    for regime in REGIMES:
        summary[f"{regime}_fixed_over_rloo"] = ratio(regime, "fixed", "rloo", "turns_var")
    summary.update({f"{regime}_{est}_{key}": round(results[regime][est][key], 1)
                    for regime in REGIMES for est in ("bpo", "rloo") for key in ("turns", "rows")})
    summary.update({"trees": n_trees, "rollout_n": ROLLOUT_N, "warmup": args.warmup,
                    "explore_share": args.explore_share})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
