"""Where a tree forks: the non-anticipating fork rule, its limits, the leaf budget and the selectors.

**Invariant (non-anticipation).** Whether node v forks, and into how many children, may depend only on what is
known before v's children are sampled: v's own history, discarded probes, other subtrees, earlier trees. A fork
score therefore reads a frozen :class:`NodeView` of the node alone. Under that invariant the choice of rule changes
efficiency, never bias: each child is a fresh sample of the node's action and transitions, so the tree's Monte
Carlo value at every node is unbiased (backward induction on depth), and the mass ``Π 1/K`` of a leaf makes the
tree's score-function sum an unbiased estimate of the policy gradient. Scoring a node by its own kept turn (the
posthoc fork of ARPO, arXiv:2507.19849, and TreeRL, arXiv:2506.11902) breaks it and is offered as an ablation only.

Objects, from the longest-lived down:

* :class:`ForkPolicy` — one per agent-loop worker and tree setting. It persists across trees and training steps
  and learns only from trees that have finished (the ``quantile`` threshold).
* :class:`TreePlan` — one per tree, made by :meth:`ForkPolicy.start_tree`: the root width, the leaf budget, and
  the fork widths of each wave's candidates.

Selectors: ``topB_wave`` ranks a wave's candidates by score and forks the best within the budget and
``max_forks_per_wave``; ``quantile`` forks a candidate whose score reaches τ, the (1 − ρ) quantile of the previous
finished tree's candidate scores, ρ chosen so the expected forks match the budget (τ = −∞ before any tree).
Limits (AEPO-style, arXiv:2510.14545): ``min_depth``, ``max_forks_per_path``, ``cooldown`` turns after a fork,
and at least one turn of horizon left.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

import numpy as np

from verl_bpo.core.config import BPOConfig

__all__ = ["NodeView", "ForkBudget", "is_eligible", "TreePlan", "ForkPolicy"]


@dataclasses.dataclass(frozen=True)
class NodeView:
    """The only thing a fork decision may read: a node's own history, never anything below it.

    Attributes:
        node_id: the node's id within its tree.
        depth: turns from the root.
        history: the node's history h_v (token ids, or a state for tabular problems); immutable.
        parent_turn_surprisal: mean −log π of the turn that led here; ``None`` at the root.
        forks_on_path: forks on the path from the root to here, the root fork excluded.
        turns_since_fork: turns since the last fork on this path (the root counts as a fork).
        horizon_left: turns the path may still take (``bpo.max_turns`` minus depth).
    """

    node_id: int
    depth: int
    history: Hashable
    parent_turn_surprisal: float | None
    forks_on_path: int
    turns_since_fork: int
    horizon_left: int


def is_eligible(view: NodeView, config: BPOConfig) -> bool:
    """AEPO-style limits: depth, forks per path, cooldown, and at least one turn of horizon left."""
    if view.depth < max(config.min_depth, 1):
        return False
    if config.max_forks_per_path is not None and view.forks_on_path >= config.max_forks_per_path:
        return False
    if view.turns_since_fork <= config.cooldown:
        return False
    return view.horizon_left >= 1


class ForkBudget:
    """Leaves still to be created: N − K0 after the root fork; a fork with K children uses K − 1."""

    def __init__(self, n_leaves: int, root_width: int) -> None:
        self.leaves_left = n_leaves - root_width

    def spend(self, children: int) -> None:
        if not 2 <= children <= self.leaves_left + 1:
            raise ValueError(f"a fork of {children} children does not fit the {self.leaves_left} leaves left")
        self.leaves_left -= children - 1


class TreePlan:
    """The fork decisions of one tree (made by :meth:`ForkPolicy.start_tree`; read by the tree sampler)."""

    def __init__(self, config: BPOConfig, n_leaves: int, threshold: float) -> None:
        self.config = config
        self.n_leaves = n_leaves
        self.root_width = config.root_width(n_leaves)
        self.budget = ForkBudget(n_leaves, self.root_width)
        self.forks_wanted = math.ceil(self.budget.leaves_left / (config.k - 1))  # forks of K the budget allows
        self.threshold = threshold  # quantile's τ, fixed for the tree when it starts
        self.scores: list[float] = []  # every candidate's score, in decision order

    @property
    def leaves_left(self) -> int:
        return self.budget.leaves_left

    def eligible(self, view: NodeView) -> bool:
        """Candidates are scored even once the budget is spent: ``quantile`` learns ρ from all of them."""
        return is_eligible(view, self.config)

    def widths(self, scores: Sequence[float]) -> list[int]:
        """Children for each of a wave's eligible candidates (1 = no fork), within the leaves left.

        Only the candidates' own scores are read, and every width is decided before any child is drawn.
        """
        self.scores.extend(scores)
        k, room = self.config.k, self.budget.leaves_left
        widths = [1] * len(scores)
        if self.config.selector == "topB_wave":
            order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep arrival order
            cap = self.config.max_forks_per_wave
        else:
            order = [i for i, s in enumerate(scores) if s >= self.threshold]
            cap = None
        for i in order:
            if room <= 0 or (cap is not None and sum(w > 1 for w in widths) >= cap):
                break
            widths[i] = min(k, room + 1)
            room -= widths[i] - 1
        return widths

    def spend(self, children: int) -> None:
        """A fork of ``children`` was made (fewer than planned when restores failed)."""
        self.budget.spend(children)


class ForkPolicy:
    """Decides the shape of every tree one agent-loop worker grows, and learns across them.

    Persistent state is updated by :meth:`finish_tree` only, from a tree whose growth is over; a tree reads the
    state once, when :meth:`start_tree` makes its plan. Both keep the fork rule non-anticipating.
    """

    def __init__(self, config: BPOConfig) -> None:
        if config.mode == "auto":
            raise ValueError("resolve bpo.mode=auto with BPOConfig.for_estimator() before building a ForkPolicy")
        self.config = config
        self.threshold: dict[int, float] = {}  # quantile τ per leaf count N, from the last finished tree
        self.trees_finished = 0

    def start_tree(self, n_leaves: int) -> TreePlan:
        return TreePlan(self.config, n_leaves, self.threshold.get(n_leaves, -math.inf))

    def finish_tree(self, plan: TreePlan) -> None:
        """Learn from a finished tree: ρ = forks the budget allowed / candidates seen; τ = their (1 − ρ) quantile."""
        self.trees_finished += 1
        if self.config.selector != "quantile" or not plan.scores:
            return
        rate = min(1.0, plan.forks_wanted / len(plan.scores))
        threshold = -math.inf if rate >= 1.0 else float(np.quantile(np.asarray(plan.scores), 1.0 - rate))
        self.threshold[plan.n_leaves] = threshold
