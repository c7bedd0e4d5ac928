"""Where ``bpo.allocation=learned`` spends a tree, per depth, at a learning task's warm start: a diagnostic.

The learning benchmark (``benchmarks/learning.py``) says whether BPO trains faster than GRPO; when it does not, the
first question is whether the allocator put its forks where the return is decided. This grows ``--batches`` batches
of BPO trees at the warm-start policy of ``--task`` with the learning benchmark's trainer, tree settings and task
batches (after ``--warmup`` batches that teach the profile, as its gradient draws do; the weights never change; each
tree's token budget is N flat rollouts' worth under the profile), and counts per depth (turn index):

* ``forks``: nodes at that depth with two or more children, and their mean ``width``;
* ``forks_decisive``: those whose children's subtrees differ in mean return (the fork averaged a real difference;
  a fork whose children all end the same way spent its leaves on nothing the advantage can use);
* the fork policy's learned profile (``bpo/profile/...``: injected return variance, gradient mass and survival per
  depth) after the last tree.

    python benchmarks/tree_shapes.py --task hard_late [--batches 36] [--warmup 4] [--seed 0]

Last line: one JSON object: ``by_depth`` (depth -> forks, width, forks_decisive), ``decisive_share`` (decisive forks
over all forks, root excluded), ``leaves``, ``leaf_turns`` and ``generated_tokens`` per tree, ``success`` (mass-
weighted), ``plans`` (trees per plan: explore / learned), ``profile``, the settings and ``wall_s``. About a minute
for ``hard_late`` on two cores, plus a few minutes when ``--out`` holds no warm start for the task's exact settings.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from learning import trainer, tree_settings, warm_start_batches

from verl_bpo.demo.tasks import TASKS, task_model


# The per-tree figures in the JSON line, from the sampler's own tree metrics (``verl_bpo.rollout.metrics``).
PER_TREE = {"leaves": "bpo/leaves", "leaf_turns": "bpo/leaf_depth", "generated_tokens": "bpo/generated_tokens",
            "success": "bpo/success_rate"}


def fork_account(trees: Iterable[tuple[Sequence[Sequence[int]], Sequence[float]]]) -> dict[int, dict[str, float]]:
    """Per depth, the forks of ``trees`` (each: its leaves' root-to-leaf node paths and their returns).

    A node at depth ``d`` is ``path[d]``; it forks when the leaves through it go on to two or more distinct
    ``path[d + 1]``. Returns ``{d: {"forks", "width", "forks_decisive"}}`` for the depths with a fork, where a fork
    is decisive when its children's mean leaf returns are not all equal.
    """
    forks: collections.Counter[int] = collections.Counter()
    decisive: collections.Counter[int] = collections.Counter()
    widths: dict[int, list[int]] = collections.defaultdict(list)
    for paths, returns in trees:
        below: dict[tuple[int, int], dict[int, list[float]]] = collections.defaultdict(
            lambda: collections.defaultdict(list))
        for path, ret in zip(paths, returns):
            for d, (node, child) in enumerate(zip(path, path[1:])):
                below[(d, node)][child].append(float(ret))
        for (d, _), children in below.items():
            if len(children) < 2:
                continue
            means = [np.mean(r) for r in children.values()]
            forks[d] += 1
            widths[d].append(len(children))
            decisive[d] += int(max(means) - min(means) > 1e-12)
    return {d: {"forks": forks[d], "width": round(float(np.mean(widths[d])), 2), "forks_decisive": decisive[d]}
            for d in sorted(forks)}


def decisive_share(by_depth: dict[int, dict[str, float]]) -> float:
    """Decisive forks over all forks below the root (the root always forks; NaN when nothing else did)."""
    below = [v for d, v in by_depth.items() if d > 0]
    total = sum(v["forks"] for v in below)
    return sum(v["forks_decisive"] for v in below) / total if total else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="hard_late", choices=sorted(TASKS))
    parser.add_argument("--batches", type=int, default=36, help="measured batches (task.batch trees each)")
    parser.add_argument("--warmup", type=int, default=4, help="batches that teach the profile first, not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/learning"), help="where the warm start is cached")
    args = parser.parse_args()
    t0 = time.monotonic()
    task = TASKS[args.task]
    rl = trainer(task_model(args.out, task), task, "bpo", args.seed, tree_settings())
    trees, plans, per_tree = [], collections.Counter(), collections.defaultdict(list)
    for results in warm_start_batches(rl, task, args.seed, args.batches, args.warmup):
        for result in results:
            plans[result.record.plan] += 1
            trees.append((result.record.leaf_paths, result.record.leaf_returns))
            for key, metric in PER_TREE.items():
                per_tree[key].append(result.metrics[metric])
    by_depth = fork_account(trees)
    for d, v in by_depth.items():
        print(f"depth {d}: {v['forks']} forks, width {v['width']}, {v['forks_decisive']} decisive")
    print(json.dumps({
        "task": args.task, "trees": len(trees), "by_depth": by_depth,
        "decisive_share": round(decisive_share(by_depth), 4),
        **{k: round(float(np.mean(v)), 3) for k, v in per_tree.items()},
        "plans": dict(plans), "profile": {k: round(v, 4) for k, v in rl.policies["bpo"].profile.metrics().items()},
        "batches": args.batches, "warmup": args.warmup, "seed": args.seed, "wall_s": round(time.monotonic() - t0),
    }))


if __name__ == "__main__":
    main()
