"""The ``bpo`` advantage estimator, registered in verl's estimator registry.

Branching Policy Optimization: each task grows one tree; every turn is credited with the leave-one-out advantage
among its siblings (Kool et al. 2019, RLOO, applied at every fork), and each leaf row is weighted by its mass
``w = Π 1/K``. In the **leaf** row layout (one row per leaf, shared prefixes duplicated) the token advantage is

    Ã = s · w_leaf · A_segment(token),      s = rows per tree of the batch (verl_bpo.integration.batch_layout)

so that verl's ``seq-mean-token-sum`` aggregation, which divides by a fixed row count, gives
(1/B) Σ_trees Σ_e W_e Σ_{turns ∈ e} ∇log π · A_e — the unbiased tree policy gradient, for trees of any leaf count.
With one fork of N children at the root it is exactly RLOO (``compute_rloo_outcome_advantage``), and with the
ablations ``bpo.ablation.mean_incl_self=true bpo.ablation.group_std=true`` GRPO (Shao et al. 2024,
arXiv:2402.03300).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.leaf_meta import LeafMeta, build_leaf_rows
from verl_bpo.core.tree import compute_credit, paint_spans
from verl_bpo.integration.batch_layout import rows_per_tree as _rows_per_tree

__all__ = ["ESTIMATOR_NAME", "compute_bpo_advantage", "tree_call_context"]

ESTIMATOR_NAME = "bpo"

_MISSING_META = (
    "the `bpo` advantage estimator needs the tree metadata of every row (keyword `tree_meta`), which only the BPO "
    "trainer passes. Launch BPO with `python -m verl_bpo.main algorithm.adv_estimator=bpo ...`, or with verl's "
    "`python -m verl.trainer.main_ppo ... algorithm.adv_estimator=bpo` while verl-bpo is installed (both wire the "
    "tree agent loop and the trainer that forwards the metadata)."
)


# verl calls estimators with a fixed set of keywords (ray_trainer.compute_advantage); the BPO trainer hands the
# tree metadata over through this context instead of copying verl's advantage code.
_TREE_CALL: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("bpo_tree_call", default=None)


@contextlib.contextmanager
def tree_call_context(tree_meta: Sequence[Any], bpo_config: BPOConfig | Mapping[str, Any] | None = None,
                      rows_per_tree: float | None = None) -> Iterator[dict[str, Any]]:
    """Within the block, ``compute_bpo_advantage`` called without ``tree_meta`` uses these rows, settings and
    advantage scale; the yielded dict receives the estimator's statistics under ``"stats"``."""
    call = {"tree_meta": tree_meta, "bpo_config": bpo_config, "rows_per_tree": rows_per_tree, "stats": {}}
    token = _TREE_CALL.set(call)
    try:
        yield call
    finally:
        _TREE_CALL.reset(token)


@register_adv_est(ESTIMATOR_NAME)
def compute_bpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    tree_meta: Sequence[Mapping[str, Any] | LeafMeta | None] | None = None,
    bpo_config: BPOConfig | Mapping[str, Any] | None = None,
    rows_per_tree: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute BPO token advantages for a batch of leaf rows.

    Args:
        token_level_rewards: ``(bs, response_length)``; a row's sum is its return. What it holds beyond the row's
            ``turn_rewards`` (verl's KL-in-reward penalty, reward shaping) is credited to the row's last turn.
        response_mask: ``(bs, response_length)``; 1 on generated tokens, 0 on environment tokens and padding.
        index: ``(bs,)`` verl's prompt uid per row; all rows of one tree share it. Rows whose uid starts with
            ``pad`` (verl's batch padding) get zero advantage.
        config: verl's ``algorithm`` config; ``gamma`` is read from it.
        tree_meta: ``(bs,)`` per-row :class:`~verl_bpo.core.leaf_meta.LeafMeta` (or its dict form); required.
        bpo_config: the ``bpo`` settings (``discount_weighting`` and the ``ablation`` block are read).
        rows_per_tree: the advantage scale s, rows the loss divides by per tree (the BPO trainer passes it);
            default: this batch's rows over its trees, right for a loss over the whole batch with
            ``global_batch_size = bs`` (see :mod:`verl_bpo.integration.batch_layout`).

    Returns:
        advantages: ``(bs, response_length)`` ``s · w_leaf · A_segment`` on generated tokens, 0 elsewhere.
        returns: ``(bs, response_length)`` the Q̂ estimate of each token's turn (return-to-go along the tree).
    """
    call = _TREE_CALL.get()
    if tree_meta is None and call is not None:
        tree_meta = call["tree_meta"]
        bpo_config = bpo_config if bpo_config is not None else call["bpo_config"]
        rows_per_tree = rows_per_tree if rows_per_tree is not None else call["rows_per_tree"]
    if tree_meta is None:
        raise ValueError(_MISSING_META)
    bs, length = response_mask.shape
    if len(tree_meta) != bs:
        raise ValueError(f"tree_meta has {len(tree_meta)} entries for a batch of {bs} rows; need one per row")
    if not isinstance(bpo_config, BPOConfig):
        bpo_config = BPOConfig.from_mapping(bpo_config)
    gamma = float(_get(config, "gamma", 1.0))
    with torch.no_grad():
        active = (response_mask.sum(dim=-1) > 0).cpu().numpy()
        totals = token_level_rewards.sum(dim=-1).double().cpu().numpy()
        leaf_rows = build_leaf_rows(tree_meta, index, totals, np.full(bs, length), active)
        credit = compute_credit(leaf_rows.forest, bpo_config, gamma)
        if rows_per_tree is None:
            rows_per_tree = _rows_per_tree(bs, leaf_rows.num_trees) if leaf_rows.num_trees else 0.0

        # Leaf layout: the turn of row r leading into node n gets s · w_leaf(r) · A(n).
        row_scale = np.zeros(bs)
        row_scale[leaf_rows.rows] = rows_per_tree * credit.mass[leaf_rows.leaf_node]
        node = leaf_rows.turn_node
        adv_values = row_scale[leaf_rows.turn_row] * credit.advantage[node]
        spans = (leaf_rows.turn_row, leaf_rows.turn_start, leaf_rows.turn_end)
        advantages, returns = paint_spans((bs, length), *spans, adv_values, credit.q[node])

        if call is not None:
            call["stats"].update(group_stats(leaf_rows.forest, credit))
        mask = response_mask.to(torch.float32)
        advantages = torch.from_numpy(advantages).to(mask.device) * mask
        returns = torch.from_numpy(returns).to(mask.device) * mask
    return advantages, returns


def _get(cfg: Any, key: str, default: Any) -> Any:
    """``cfg[key]`` of a DictConfig, mapping or object; ``default`` when absent or null."""
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def group_stats(forest, credit) -> dict[str, float]:
    """Sibling-group statistics for verl's logger: how many groups carry no signal (all siblings equal)."""
    child = np.flatnonzero(~forest.is_root)
    fork_child = child[forest.num_children[forest.parent[child]] >= 2]
    if fork_child.size == 0:
        return {"bpo/sibling_groups": 0.0}
    parent = forest.parent[fork_child]
    q_min = np.full(forest.size, np.inf)
    q_max = np.full(forest.size, -np.inf)
    np.minimum.at(q_min, parent, credit.q[fork_child])
    np.maximum.at(q_max, parent, credit.q[fork_child])
    groups = np.unique(parent)
    return {
        "bpo/sibling_groups": float(groups.size),
        "bpo/zero_advantage_group_share": float(np.mean(q_max[groups] - q_min[groups] < 1e-12)),
        "bpo/mean_abs_advantage": float(np.mean(np.abs(credit.advantage[fork_child]))),
    }
