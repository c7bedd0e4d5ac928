"""The ``bpo`` advantage estimator, registered in verl's estimator registry.

Branching Policy Optimization: each task grows one tree of N leaves; every turn is credited with the leave-one-out
advantage among its siblings, and each leaf row is weighted by its mass ``w = Π 1/K`` (research/anchors.md §3.5).
In the **leaf** row layout (one row per leaf, shared prefixes duplicated) the token advantage is

    Ã = N · w_leaf · A_segment(token)

so that verl's ``seq-mean-token-sum`` aggregation (mean over rows, sum over tokens) gives, per tree,
Σ_e W_e Σ_{turns ∈ e} ∇log π · A_e — the unbiased BPO gradient. With one fork of N children at the root it is
exactly RLOO (``compute_rloo_outcome_advantage``), and with ``baseline="mean_incl_self", scale="group_std"`` GRPO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est

from verl_bpo.tree import CreditOptions, compute_credit, paint_spans
from verl_bpo.tree_meta import LeafMeta, build_leaf_rows

__all__ = ["ESTIMATOR_NAME", "compute_bpo_advantage", "credit_options"]

ESTIMATOR_NAME = "bpo"

_MISSING_META = (
    "the `bpo` advantage estimator needs the tree metadata of every row (keyword `tree_meta`), which only the BPO "
    "trainer passes. Launch BPO with `python -m verl_bpo.main algorithm.adv_estimator=bpo ...` (it wires the tree "
    "agent loop and the trainer that forwards the metadata) instead of `python -m verl.trainer.main_ppo`."
)


def credit_options(config: Any = None, bpo_config: Any = None) -> CreditOptions:
    """Build :class:`CreditOptions` from verl's ``algorithm`` config (``gamma``) and the ``bpo`` config block."""

    def get(cfg: Any, key: str, default: Any) -> Any:
        if cfg is None:
            return default
        if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
            value = cfg.get(key, default)
        else:
            value = getattr(cfg, key, default)
        return default if value is None else value

    defaults = CreditOptions()
    return CreditOptions(
        gamma=float(get(config, "gamma", defaults.gamma)),
        baseline=get(bpo_config, "baseline", defaults.baseline),
        scale=get(bpo_config, "scale", defaults.scale),
        discount_weighting=get(bpo_config, "discount_weighting", defaults.discount_weighting),
        epsilon=float(get(bpo_config, "epsilon", defaults.epsilon)),
    )


@register_adv_est(ESTIMATOR_NAME)
def compute_bpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    tree_meta: Sequence[Mapping[str, Any] | LeafMeta | None] | None = None,
    bpo_config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute BPO token advantages for a batch of leaf rows.

    Args:
        token_level_rewards: ``(bs, response_length)``; a row's sum is its leaf return (used as the last turn's
            reward when the metadata has no ``turn_rewards``).
        response_mask: ``(bs, response_length)``; 1 on generated tokens, 0 on environment tokens and padding.
        index: ``(bs,)`` verl's prompt uid per row; all rows of one tree share it. Rows whose uid starts with
            ``pad`` (verl's batch padding) get zero advantage.
        config: verl's ``algorithm`` config; ``gamma`` is read from it.
        tree_meta: ``(bs,)`` per-row :class:`~verl_bpo.tree_meta.LeafMeta` (or its dict form); required.
        bpo_config: the ``bpo`` config block (``baseline``, ``scale``, ``discount_weighting``, ``epsilon``).

    Returns:
        advantages: ``(bs, response_length)`` ``N · w_leaf · A_segment`` on generated tokens, 0 elsewhere.
        returns: ``(bs, response_length)`` the Q̂ estimate of each token's turn (return-to-go along the tree).
    """
    if tree_meta is None:
        raise ValueError(_MISSING_META)
    bs, length = response_mask.shape
    if len(tree_meta) != bs:
        raise ValueError(f"tree_meta has {len(tree_meta)} entries for a batch of {bs} rows; need one per row")
    options = credit_options(config, bpo_config)
    with torch.no_grad():
        active = (response_mask.sum(dim=-1) > 0).cpu().numpy()
        totals = token_level_rewards.sum(dim=-1).double().cpu().numpy()
        leaf_rows = build_leaf_rows(tree_meta, index, totals, np.full(bs, length), active)
        credit = compute_credit(leaf_rows.forest, options)

        # Leaf layout: the turn of row r leading into node n gets N · w_leaf(r) · A(n).
        row_scale = np.zeros(bs)
        row_scale[leaf_rows.rows] = (credit.leaves_per_tree * credit.mass)[leaf_rows.leaf_node]
        node = leaf_rows.turn_node
        adv_values = row_scale[leaf_rows.turn_row] * credit.advantage[node]
        spans = (leaf_rows.turn_row, leaf_rows.turn_start, leaf_rows.turn_end)
        advantages, returns = paint_spans((bs, length), *spans, adv_values, credit.q[node])

        mask = response_mask.to(torch.float32)
        advantages = torch.from_numpy(advantages).to(mask.device) * mask
        returns = torch.from_numpy(returns).to(mask.device) * mask
    return advantages, returns
