"""Draw one BPO tree: nodes by depth, forks with their widths, each sibling group's advantages, leaf returns.

The CPU demo draws a tree its BPO run grew in verl's trainer: ``bpo.tree_log`` makes the trainer append each step's
first tree (leaf metadata and outcomes, the tree's metrics) as a JSON line, and :func:`draw_tree_record` reads one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from verl_bpo.core.leaf_meta import LeafMeta, build_leaf_rows
from verl_bpo.core.tree import compute_credit

__all__ = ["draw_tree", "draw_tree_record"]


def draw_tree_record(record: Mapping[str, Any], path: Path) -> None:
    """Draw a tree logged by ``bpo.tree_log`` (one JSON line: ``leaves`` with ``meta`` and ``won``, ``metrics``)."""
    metas = [LeafMeta.from_dict(leaf["meta"]) for leaf in record["leaves"]]
    won = [bool(leaf.get("won")) for leaf in record["leaves"]]
    metrics = record.get("metrics", {})
    kind = "exploration shape" if metrics.get("bpo/explore_tree") else "learned allocation"
    title = (f"A tree of step {record.get('step', '?')} ({kind}): {len(metas)} leaves, "
             f"{int(metrics.get('bpo/forks', 0))} forks, {metrics.get('bpo/generated_tokens', 0):.0f} generated tokens")
    draw_tree(metas, won, path, title)


def draw_tree(metas: list[LeafMeta], won: list[bool], path: Path, title: str = "") -> None:
    """Nodes by depth, leaves spread left to right; fork nodes marked with their width K; each segment's first
    edge annotated with its leave-one-out advantage A, each leaf with its return."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    returns = [sum(m.turn_rewards or ()) for m in metas]
    rows = build_leaf_rows(metas, None, np.array(returns), np.full(len(metas), 10**6),
                           np.ones(len(metas), dtype=bool))
    forest, credit = rows.forest, compute_credit(rows.forest)
    x = np.zeros(forest.size)
    order = sorted(range(len(metas)), key=lambda i: metas[i].node_path)  # depth-first order: no crossing edges
    x[rows.leaf_node[order]] = np.arange(len(metas))
    for level in reversed(forest.levels()[1:]):  # a parent sits above the mean of its children
        sums, counts = np.zeros(forest.size), np.zeros(forest.size)
        np.add.at(sums, forest.parent[level], x[level])
        np.add.at(counts, forest.parent[level], 1)
        inner = np.unique(forest.parent[level])
        x[inner] = sums[inner] / counts[inner]
    depth = forest.depth
    fig, ax = plt.subplots(figsize=(min(max(6, 0.45 * len(metas)), 24), 1.1 * (depth.max() + 2)))
    for n in range(1, forest.size):
        p = forest.parent[n]
        ax.plot([x[p], x[n]], [-depth[p], -depth[n]], color="0.6", zorder=1)
        if credit.segment_top[n] == n and forest.num_children[p] >= 2 and len(metas) <= 24:
            a = credit.advantage[n]
            ax.annotate(f"{a:+.2f}", ((x[p] + x[n]) / 2, -(depth[p] + depth[n]) / 2), fontsize=6,
                        color="tab:red" if a < 0 else "tab:green", ha="center")
    fork = forest.num_children >= 2
    ax.scatter(x[~fork], -depth[~fork], s=14, color="0.3", zorder=2)
    ax.scatter(x[fork], -depth[fork], s=70, marker="D", color="tab:blue", zorder=3, label="fork (snapshot), K")
    for n in np.flatnonzero(fork):
        ax.annotate(f"K={forest.num_children[n]}", (x[n], -depth[n] + 0.18), ha="center", fontsize=7,
                    color="tab:blue")
    for meta, node, ret, w in zip(metas, rows.leaf_node, returns, won):
        ax.annotate(f"{ret:.1f}" + ("★" if w else ""), (x[node], -depth[node] - 0.35), ha="center", fontsize=6)
    ax.set_ylim(-depth.max() - 0.8, 0.5)
    ax.set_yticks([-d for d in range(depth.max() + 1)], [f"turn {d}" for d in range(depth.max() + 1)])
    ax.set_xticks([])
    ax.set_title(title or f"One BPO tree: {len(metas)} leaves, {int(fork.sum())} forks", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
