"""Per-tree metrics, under the flat ``bpo/...`` names verl's logger takes (the trainer averages them over trees).

Outcome metrics are mass-weighted: a tree's success rate is Σ_ℓ w_ℓ · won_ℓ, its expected success under the
policy (the tree over-samples the subtrees below forks; the masses undo it). A flat group's masses are all 1/N, so
the same metric is a flat run's plain mean and the two compare directly.

``turn_tokens`` is the policy's turn length, mass-weighted the same way: Σ_ℓ w_ℓ · (generated tokens per turn on
ℓ's path). ``generated_tokens / env_steps`` is not: a tree generates its shared walk once and its forked turns once
per child, so its ratio follows the tree's shape (a tree forked wide at a long last turn reads 2.9 where its policy's
turns average 2.4).

Cost metrics count what the tree spent, shared prefixes once: ``env_steps`` sandbox steps (one per generated
turn), ``generated_tokens`` (probes included), ``restores``, and ``trainer_rows`` (leaf rows the trainer trains on).
``step_retries`` counts sandbox steps retried after a crash or hang (``bpo.step_retries``); ``failed_leaves`` the
leaves whose step still failed; ``grading_tampered`` the leaves whose grader found the tests' results forged (the
sandbox's ``info["grading_tampered"]``; they earn 0, and a rising count is a policy learning to attack its grader).

Wall time: ``wall_s`` of the tree, and where its branches spent theirs, summed over branches: ``generate_s``
waiting for generations, ``sandbox_s`` in sandbox steps, ``fork_s`` in snapshots and restores (a fork's, and those
that keep or rebuild the state before a step for its retries), and ``wait_s`` the rest of their lives (waiting for
a thread or an engine lock, or for the slowest branch of a wave).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from verl_bpo.core.fork_policy import Plan
from verl_bpo.rollout.tree_state import Leaf, TreeState

__all__ = ["tree_metrics"]


def tree_metrics(state: TreeState, leaves: Sequence[Leaf], plan: Plan,
                 seconds: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``plan``: the tree's plan from :meth:`~verl_bpo.core.fork_policy.ForkPolicy.start_tree`."""
    rows = max(len(leaves), 1)
    children: dict[int, set[int]] = {}
    for leaf in leaves:
        for a, b in zip(leaf.meta.node_path, leaf.meta.node_path[1:]):
            children.setdefault(a, set()).add(b)
    # A segment starts at every child of a fork, and at the root's child when the root did not fork.
    segments = sum(len(c) for c in children.values() if len(c) >= 2) or 1
    metrics = {
        "bpo/leaves": float(len(leaves)),
        "bpo/leaf_utilization": len(leaves) / plan.rollout_n,
        "bpo/forks": float(state.forks),
        "bpo/success_rate": sum(leaf.mass * leaf.won for leaf in leaves),
        "bpo/leaf_return": sum(leaf.mass * leaf.reward for leaf in leaves),
        "bpo/turn_tokens": sum(leaf.mass * _tokens_per_turn(state, leaf) for leaf in leaves),
        "bpo/failed_leaves": float(sum(leaf.failed for leaf in leaves)),
        "bpo/step_retries": float(state.step_retries),
        "bpo/truncated_leaves": float(sum(leaf.truncated for leaf in leaves)),
        "bpo/grading_tampered": float(sum(leaf.tampered for leaf in leaves)),
        "bpo/reset_failures": 0.0,
        "bpo/env_steps": float(state.turns),
        "bpo/generated_tokens": float(state.generated_tokens),
        "bpo/restores": float(len(seconds.get("restore", ()))),
        "bpo/trainer_rows": float(len(leaves)),
        "bpo/mean_segment_turns": state.turns / segments,
        "bpo/leaf_depth": sum(leaf.meta.num_turns for leaf in leaves) / rows,
        # L · Σ w²: 1 when every leaf weighs alike (a flat group), above 1 by the factor uneven masses multiply the
        # variance of the tree's sum over its leaves (were their terms independent and alike).
        "bpo/leaf_mass_factor": len(leaves) * sum(leaf.mass ** 2 for leaf in leaves) if leaves else 1.0,
        # Under a turn or token budget what is left is in turns or tokens: bpo/budget − bpo/budget_spent.
        **({"bpo/unspent_leaf_budget": float(max(plan.budget.pool, 0))} if plan.budget.unit == "leaves" else {}),
    }
    metrics.update(plan.metrics())
    for kind in ("snapshot", "restore", "step"):
        values = seconds.get(kind)
        if values:
            metrics[f"bpo/{kind}_ms"] = 1e3 * sum(values) / len(values)
    sandbox_s = sum(seconds.get("step", ()))
    fork_s = sum(seconds.get("snapshot", ())) + sum(seconds.get("restore", ())) + sum(seconds.get("recover", ()))
    metrics.update({
        "bpo/wall_s": state.wall_s, "bpo/generate_s": state.generate_s, "bpo/sandbox_s": sandbox_s,
        "bpo/fork_s": fork_s, "bpo/wait_s": max(state.branch_s - state.generate_s - sandbox_s - fork_s, 0.0),
    })
    return metrics


def _tokens_per_turn(state: TreeState, leaf: Leaf) -> float:
    """Generated tokens per turn along ``leaf``'s path (0 for a leaf that never took a turn)."""
    turns = leaf.meta.node_path[1:]
    return sum(state.turn_tokens.get(node, 0.0) for node in turns) / len(turns) if turns else 0.0
