"""Wall time of the `bpo` estimator vs verl's own `grpo` estimator on the same batch, measured side by side.

Batch: 512 leaf rows × 2048 response tokens (~1M tokens), 64 trees of 8 leaves (root fork K0=2, then forks of
K=2), 4–8 turns per leaf with environment tokens between turns. Both estimators get identical tensors; bpo also
gets the per-row tree metadata. Median of several repeats after one warm-up call each.

    python benchmarks/estimator_speed.py [--rows 512] [--length 2048] [--repeats 5]

Last line: {"bpo_over_grpo_time": .., "bpo_ms": ..}. Target: ratio <= 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

import verl_bpo.integration.estimator  # noqa: F401  (registers "bpo")
from verl_bpo.core.leaf_meta import LeafMeta


def synthetic_trees(rows: int, length: int, leaves: int, rng: np.random.Generator):
    """Leaf rows of random binary trees: LeafMeta per row, token-level rewards, response mask, uids."""
    metas, uids = [], []
    rewards = torch.zeros(rows, length)
    mask = torch.zeros(rows, length)
    for tree in range(rows // leaves):
        horizon = int(rng.integers(4, 9))
        turn_len = length // horizon
        paths, next_id = [[0], [0]], 1  # the root fork, K0 = 2
        fork_depths = rng.integers(1, horizon, size=leaves - 2)
        for depth in range(horizon):
            for _ in range(int((fork_depths == depth).sum())):  # a copy of a path diverges from its next turn
                paths.append(list(paths[int(rng.integers(len(paths)))]))
            for p in paths:
                p.append(next_id)
                next_id += 1
        edges = {(p[t], p[t + 1]) for p in paths for t in range(horizon)}
        fanout = np.bincount([u for u, _ in edges], minlength=next_id)
        for leaf_id, path in enumerate(paths):
            row = tree * leaves + leaf_id
            spans = tuple((t * turn_len, t * turn_len + turn_len // 2) for t in range(horizon))
            for s, e in spans:
                mask[row, s:e] = 1
            rewards[row, spans[-1][1] - 1] = float(rng.random() < 0.5)
            mass = float(np.prod([1.0 / fanout[u] for u in path[:-1]]))
            metas.append(LeafMeta(f"t{tree}", leaf_id, tuple(path), spans, mass))
            uids.append(f"t{tree}")
    return metas, rewards, mask, np.array(uids, dtype=object)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--leaves", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    metas, rewards, mask, uids = synthetic_trees(args.rows, args.length, args.leaves, rng)
    bpo, grpo = get_adv_estimator_fn("bpo"), get_adv_estimator_fn("grpo")
    bpo_adv, _ = bpo(rewards, mask, index=uids, tree_meta=metas)  # also validates the synthetic batch
    assert bpo_adv.abs().sum() > 0

    t_grpo = timed(lambda: grpo(rewards.clone(), mask, index=uids), args.repeats)
    t_bpo = timed(lambda: bpo(rewards, mask, index=uids, tree_meta=metas), args.repeats)
    turns = sum(m.num_turns for m in metas)
    print(f"batch: {args.rows} rows x {args.length} tokens = {mask.numel() / 1e6:.2f}M tokens, "
          f"{args.rows // args.leaves} trees of {args.leaves} leaves, {turns} turns")
    print(f"grpo (verl): {t_grpo * 1e3:8.1f} ms")
    print(f"bpo:         {t_bpo * 1e3:8.1f} ms")
    print(json.dumps({"bpo_over_grpo_time": round(t_bpo / t_grpo, 3), "bpo_ms": round(t_bpo * 1e3, 1),
                      "grpo_ms": round(t_grpo * 1e3, 1), "tokens": mask.numel()}))


if __name__ == "__main__":
    main()
