"""Random BPO trees laid out as verl leaf rows, for the estimator and tree-math tests."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from verl_bpo.core.leaf_meta import LeafMeta


@dataclasses.dataclass
class LeafBatch:
    """A batch of leaf rows as the trainer hands them to the estimator."""

    metas: list[LeafMeta]
    uids: np.ndarray
    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor


def random_tree_paths(rng: np.random.Generator, n_leaves: int, k0: int, k_choices=(2, 3), horizon: int = 4,
                      stop_prob: float = 0.25, fork_prob: float = 0.5) -> tuple[list[int], list[list[int]]]:
    """Grow a random tree; return the parent array and each leaf's node path (root first)."""
    parent = [-1]
    budget = n_leaves - k0
    active = [[0] for _ in range(k0)]
    leaves = []
    while active:
        next_active = []
        for path in active:
            parent.append(path[-1])
            path = path + [len(parent) - 1]
            if len(path) - 1 >= horizon or rng.random() < stop_prob:
                leaves.append(path)
            elif budget > 0 and rng.random() < fork_prob:
                k = min(int(rng.choice(k_choices)), budget + 1)
                budget -= k - 1
                next_active.extend(list(path) for _ in range(k))
            else:
                next_active.append(path)
        active = next_active
    return parent, leaves


def leaf_batch(rng: np.random.Generator, n_trees: int = 3, n_leaves: int = 6, k0: int = 2, k_choices=(2, 3),
               horizon: int = 4, response_length: int = 96, per_turn_rewards: bool = True,
               flat: bool = False) -> LeafBatch:
    """Several random trees as leaf rows (shared turns have one length and one reward in every leaf)."""
    metas, uids, rewards, masks = [], [], [], []
    for tree in range(n_trees):
        if flat:
            parent = [-1] + [0] * n_leaves
            chain_len = rng.integers(1, horizon + 1, size=n_leaves)
            leaves = []
            for i in range(n_leaves):  # a chain of turns per leaf below a root fork of N
                path = [0, i + 1]
                for _ in range(chain_len[i] - 1):
                    parent.append(path[-1])
                    path.append(len(parent) - 1)
                leaves.append(path)
        else:
            parent, leaves = random_tree_paths(rng, n_leaves, k0, k_choices, horizon)
        node_reward = rng.normal(size=len(parent)).round(3)
        node_tokens = rng.integers(1, 6, size=len(parent))
        k = np.bincount(np.array(parent[1:]), minlength=len(parent))
        for leaf_id, path in enumerate(leaves):
            spans, pos = [], 0
            for node in path[1:]:
                spans.append((pos, pos + int(node_tokens[node])))
                pos += int(node_tokens[node]) + int(rng.integers(0, 4))  # environment tokens between turns
            assert pos <= response_length
            mass = float(np.prod([1.0 / k[u] for u in path[:-1]]))
            turn_rewards = tuple(float(node_reward[n]) for n in path[1:])
            metas.append(LeafMeta(f"tree{tree}", leaf_id, tuple(path), tuple(spans), mass,
                                  turn_rewards if per_turn_rewards else None))
            uids.append(f"uid{tree}")
            mask = torch.zeros(response_length)
            for s, e in spans:
                mask[s:e] = 1
            rew = torch.zeros(response_length)
            rew[spans[-1][1] - 1] = sum(turn_rewards) if per_turn_rewards else float(node_reward[path[-1]])
            rewards.append(rew)
            masks.append(mask)
    order = rng.permutation(len(metas))  # verl does not keep the rows of a tree together
    return LeafBatch([metas[i] for i in order], np.array(uids, dtype=object)[order],
                     torch.stack(rewards)[order], torch.stack(masks)[order])
