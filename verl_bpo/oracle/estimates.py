"""Growing many trees on a tabular problem through the production sampler, and each tree's gradient estimate.

:func:`sample_trees` runs the real :class:`~verl_bpo.rollout.sampler.TreeSampler` (one fork policy across all
trees, as an agent-loop worker keeps one) in the tabular sandbox under the tabular policy. :func:`tree_gradients`
turns each tree into ĝ = Σ_turns W_e · A_e · ∇log π(a | t, x) with the production credit
(:func:`~verl_bpo.core.tree.compute_credit` on the leaves' metadata), in numpy: what verl's loss computes, without
torch (the production-path tests check the two agree exactly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.core.leaf_meta import build_leaf_rows
from verl_bpo.core.tree import compute_credit
from verl_bpo.oracle.mdp import problem, softmax_policy
from verl_bpo.oracle.policy import TabularCodec, TabularPolicy
from verl_bpo.oracle.sandbox import TabularSandbox
from verl_bpo.rollout.sampler import TreeSampler
from verl_bpo.rollout.tree_state import Leaf, TreeResult

__all__ = ["sample_trees", "tree_gradients", "mean_turns"]


def sample_trees(problem_name: str, problem_args: dict, config: BPOConfig, rollout_n: int, n_trees: int,
                 seed: int = 0, fail_prob: float = 0.0, policy: ForkPolicy | None = None,
                 concurrency: int = 64) -> list[TreeResult]:
    """``n_trees`` trees of ``config`` (mode resolved) on the named problem, grown ``concurrency`` at a time."""
    mdp, theta = problem(problem_name, **problem_args)
    codec = TabularCodec(mdp)
    llm = TabularPolicy(theta, codec, seed=seed)
    policy = policy or ForkPolicy(config)
    sandbox = TabularSandbox.Config(problem=problem_name, problem_args=dict(problem_args), fail_prob=fail_prob)
    length = 2 * mdp.horizon + 2

    async def grow(i: int) -> TreeResult:
        sampler = TreeSampler(config, rollout_n, length, lambda: TabularSandbox(sandbox), {}, llm, codec,
                              tree_id=f"t{seed}-{i}", policy=policy, seed=seed * 10**7 + i)
        return await sampler.run()

    async def grow_all() -> list[TreeResult]:
        out: list[TreeResult] = []
        for start in range(0, n_trees, concurrency):
            out += await asyncio.gather(*(grow(i) for i in range(start, min(start + concurrency, n_trees))))
        return out

    return asyncio.run(grow_all())


def tree_gradients(theta: np.ndarray, trees: Sequence[Sequence[Leaf]], codec: TabularCodec, config: BPOConfig,
                   gamma: float, weights: str = "mass") -> np.ndarray:
    """ĝ of each tree, ``(n_trees, T, X, A)``: Σ over its turns of W_e · A_e · ∇log π(a | t, x), from the
    production credit (:func:`~verl_bpo.core.tree.compute_credit` on the trees' leaf metadata).

    ``weights="uniform"`` is a negative control: every leaf counts 1 / (leaves of its tree) instead of its mass.
    """
    leaves = [leaf for tree in trees for leaf in tree]
    metas = [leaf.meta for leaf in leaves]
    rows = build_leaf_rows(metas, None, np.array([leaf.reward for leaf in leaves]),
                           np.array([len(leaf.transcript.response_mask) for leaf in leaves]),
                           np.array([any(leaf.transcript.response_mask) for leaf in leaves]))
    credit = compute_credit(rows.forest, config, gamma)
    row_weight = credit.mass[rows.leaf_node]
    if weights == "uniform":
        row_weight = 1.0 / np.bincount(rows.tree_of_row)[rows.tree_of_row]
    # One entry per (row, turn): the state before the turn's action token, the action, and its coefficient.
    weight_of_row = dict(zip(rows.rows.tolist(), row_weight.tolist()))
    tree_of = dict(zip(rows.rows.tolist(), rows.tree_of_row.tolist()))
    t, x, a, coef, tree = [], [], [], [], []
    for row, start, node in zip(rows.turn_row.tolist(), rows.turn_start.tolist(), rows.turn_node.tolist()):
        transcript = leaves[row].transcript
        if not transcript.response_mask[start]:
            continue  # a masked (failed) turn takes no part in the loss
        state = codec.token_state(transcript.token_ids[transcript.prompt_length + start - 1])
        t.append(state[0])
        x.append(state[1])
        a.append(transcript.token_ids[transcript.prompt_length + start])
        coef.append(weight_of_row[row] * credit.advantage[node])
        tree.append(tree_of[row])
    t, x, a = np.array(t, dtype=np.int64), np.array(x, dtype=np.int64), np.array(a, dtype=np.int64)
    pi = softmax_policy(theta)
    score = -pi[t, x]
    score[np.arange(len(a)), a] += 1.0
    grads = np.zeros((len(trees), *theta.shape))
    np.add.at(grads, (np.array(tree, dtype=np.int64), t, x), np.array(coef)[:, None] * score)
    return grads


def mean_turns(trees: Sequence[Sequence[Leaf]]) -> float:
    """Distinct generated turns per tree (shared prefixes count once)."""
    return float(np.mean([len({n for leaf in tree for n in leaf.meta.node_path}) - 1 for tree in trees]))

