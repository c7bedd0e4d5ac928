"""Grow one BPO tree with a local Hugging Face model (no server) and draw it: forks, returns, advantages.

Used by the CPU demo; the tree is sampled in-process (``verl_bpo.local.hf_client``) from the warm-started model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sandbox_adapters.registry import make_sandbox
from verl_bpo.core.config import BPOConfig
from verl_bpo.core.leaf_meta import build_leaf_rows
from verl_bpo.core.tree import compute_credit
from verl_bpo.local.hf_client import BatchedHFClient, TemplateCodec
from verl_bpo.rollout.sampler import TreeSampler
from verl_bpo.rollout.tree_state import TreeResult

__all__ = ["sample_tree", "draw_tree", "draw_sampled_tree"]


def sample_tree(model_dir: str | Path, sandbox: str, sandbox_config: Mapping, task: Mapping, n_leaves: int,
                max_turns: int = 6, seed: int = 0) -> TreeResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = BPOConfig(mode="tree", k=2, k0=2, max_forks_per_wave=2, max_turns=max_turns, max_tokens_per_turn=6)
    sampler = TreeSampler(config, n_leaves, 1024, lambda: make_sandbox(sandbox, sandbox_config), task,
                          BatchedHFClient(model, tokenizer), TemplateCodec(tokenizer), tree_id="picture", seed=seed)
    return asyncio.run(sampler.run())


def draw_tree(result: TreeResult, path: Path, title: str = "") -> None:
    """Nodes by depth, leaves spread left to right; fork nodes marked;
    each segment's first edge annotated with its advantage A, each leaf with its return."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metas = [leaf.meta for leaf in result.leaves]
    rows = build_leaf_rows(metas, None, np.array([leaf.reward for leaf in result.leaves]),
                           np.full(len(metas), 10**6), np.ones(len(metas), dtype=bool))
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
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(metas)), 1.2 * (forest.depth.max() + 2)))
    for n in range(1, forest.size):
        p = forest.parent[n]
        ax.plot([x[p], x[n]], [-forest.depth[p], -forest.depth[n]], color="0.6", zorder=1)
        if credit.segment_top[n] == n and forest.num_children[p] >= 2:
            a = credit.advantage[n]
            ax.annotate(f"A={a:+.2f}", ((x[p] + x[n]) / 2, -(forest.depth[p] + forest.depth[n]) / 2),
                        fontsize=7, color="tab:red" if a < 0 else "tab:green", ha="center")
    fork = forest.num_children >= 2
    ax.scatter(x[~fork], -forest.depth[~fork], s=18, color="0.3", zorder=2)
    ax.scatter(x[fork], -forest.depth[fork], s=70, marker="D", color="tab:blue", zorder=3, label="fork (snapshot)")
    for leaf, node in zip(result.leaves, rows.leaf_node):
        ax.annotate(f"R={leaf.reward:.1f}" + (" won" if leaf.won else ""), (x[node], -forest.depth[node] - 0.35),
                    ha="center", fontsize=7)
    ax.set_ylim(-forest.depth.max() - 0.8, 0.4)
    ax.set_yticks([-d for d in range(forest.depth.max() + 1)], [f"turn {d}" for d in range(forest.depth.max() + 1)])
    ax.set_xticks([])
    ax.set_title(title or f"One BPO tree: {len(metas)} leaves, {int(fork.sum())} forks (LOO sibling advantages)")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_sampled_tree(model_dir: str | Path, path: Path, sandbox_config: Mapping, task: Mapping, n_leaves: int) -> None:
    result = sample_tree(model_dir, "smoke", sandbox_config, task, n_leaves)
    draw_tree(result, path)

