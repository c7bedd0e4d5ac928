"""How a batch of tree rows is normalised, so that verl's loss gives exactly the BPO gradient.

verl's ``seq-mean-token-sum(-norm)`` aggregation divides each mini-batch's sum over rows by a fixed row count
(``global_batch_size``, and ``loss_scale_factor`` for ``-norm``), whatever those rows are. A BPO batch of B trees
has R rows (one per leaf; R varies with the trees' leaf counts and verl's padding), split into ``minibatches``
mini-batches of R / minibatches rows. Painting each token with ``s · w_leaf · A_segment``, where

    s = R / B                                       (rows per tree: :func:`rows_per_tree`)

and dividing each mini-batch by R / minibatches rows (:func:`minibatch_rows`), gives every mini-batch the
gradient (minibatches / B) Σ_{its rows} w A ∇log π; with one mini-batch that is exactly

    (1/B) Σ_trees Σ_segments W_e A_e ∇log π

for trees of any leaf count. Scaling by each tree's own leaf count instead under-weights trees whose paths ended
before their forks and over-weights trees with more leaves than ``rollout.n``. With R = B · rollout.n (every tree
full) both numbers are verl's own (s = rollout.n, rows = ppo_mini_batch_size · rollout.n).
"""

from __future__ import annotations

import math

__all__ = ["rows_per_tree", "minibatch_rows", "batch_multiple"]


def rows_per_tree(rows: int, trees: int) -> float:
    """The advantage scale s = R / B: rows of the (padded) batch over the trees in it."""
    if trees < 1 or rows < trees:
        raise ValueError(f"a batch of {trees} trees cannot have {rows} rows")
    return rows / trees


def minibatch_rows(rows: int, minibatches: int) -> int:
    """Rows per mini-batch, the loss normalizer verl's actor gets as ``global_batch_size``."""
    if minibatches < 1 or rows % minibatches:
        raise ValueError(f"{rows} rows do not split into {minibatches} equal mini-batches")
    return rows // minibatches


def batch_multiple(verl_multiple: int, minibatches: int, dp_size: int) -> int:
    """What the padded batch must be a multiple of: verl's own multiple, and one row per data-parallel rank in
    each of ``minibatches`` equal mini-batches."""
    return math.lcm(verl_multiple, minibatches * dp_size)
