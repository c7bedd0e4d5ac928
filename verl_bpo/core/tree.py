"""BPO tree math: masses, subtree values and leave-one-out sibling advantages. Pure numpy.

A batch of trees is held as a :class:`Forest`: flat arrays over every node of every tree. A node is a decision
point (after an observation, before the next turn); the turn that led into node ``n`` is the *edge* ``n`` (its
parent is ``parent[n]``), so per-turn quantities live on the child node of the turn. Roots have ``parent = -1``.

With K_u the number of children of u (tree Monte Carlo with leave-one-out baselines: RLOO, Kool et al. 2019,
"Buy 4 REINFORCE samples, get a baseline for free!"; applied at every fork of the tree):

    masses     ω_root = 1,  ω_c = ω_u / K_u                          (leaf weight w_ℓ = ω_leaf; Σ_ℓ w_ℓ = 1)
    values     Q̂_c = r_c + γ · V̂(c),   V̂(u) = (1/K_u) Σ_{c ∈ ch(u)} Q̂_c,   V̂(leaf) = 0
    segments   the maximal chain of turns from a branch node's child edge down to the next branch node or leaf
    advantage  A_e = Q̂_e − (1/(K_u − 1)) Σ_{e' ≠ e} Q̂_{e'}           (leave-one-out among siblings)

Discounting runs along parent→child edges only, so rewards never leak between parallel branches. Every turn of
segment e is credited with A_e (times γ^{t_u} when ``discount_weighting="exact"``, t_u the depth of the fork).
A root with a single child is a group of one: it has no baseline, so its advantage is 0.

All passes are vectorised over nodes; the only Python loops run over tree depth.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from verl_bpo.core.config import BPOConfig

__all__ = ["Forest", "Credit", "compute_credit", "paint_spans"]

_DEFAULT = BPOConfig()


@dataclasses.dataclass(frozen=True)
class Forest:
    """A batch of trees as flat node arrays, parents before children.

    Attributes:
        parent: ``(n,)`` int64, index of the parent node, ``-1`` for a root; ``parent[i] < i``.
        reward: ``(n,)`` float64, reward of the turn entering each node (0 for roots).
        depth: ``(n,)`` int64, number of turns from the root (derived).
        num_children: ``(n,)`` int64, K of each node; 0 for leaves (derived).
    """

    parent: np.ndarray
    reward: np.ndarray
    depth: np.ndarray = dataclasses.field(init=False, repr=False)
    num_children: np.ndarray = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        parent = np.asarray(self.parent, dtype=np.int64)
        reward = np.asarray(self.reward, dtype=np.float64)
        n = parent.shape[0]
        if parent.ndim != 1 or reward.shape != (n,):
            raise ValueError(f"parent and reward must be 1-d of one length, got {parent.shape} and {reward.shape}")
        if np.any(parent >= np.arange(n)) or np.any(parent < -1):
            raise ValueError("every node's parent must come before it (parent[i] < i), roots have parent -1")
        depth = np.zeros(n, dtype=np.int64)
        ancestor = parent.copy()
        while np.any(alive := ancestor >= 0):  # pointer chasing: one vectorised pass per level
            depth += alive
            ancestor[alive] = parent[ancestor[alive]]
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "reward", reward)
        object.__setattr__(self, "depth", depth)
        object.__setattr__(self, "num_children", np.bincount(parent[parent >= 0], minlength=n).astype(np.int64))

    @property
    def size(self) -> int:
        return self.parent.shape[0]

    @property
    def is_leaf(self) -> np.ndarray:
        return self.num_children == 0

    @property
    def is_root(self) -> np.ndarray:
        return self.parent < 0

    def masses(self) -> np.ndarray:
        """ω of every node, top-down: ω_root = 1, ω_c = ω_u / K_u (a leaf's ω is its weight w_ℓ)."""
        mass = np.ones(self.size)
        for level in self.levels()[1:]:
            mass[level] = mass[self.parent[level]] / self.num_children[self.parent[level]]
        return mass

    def levels(self) -> list[np.ndarray]:
        """Node indices grouped by depth, shallowest first."""
        order = np.argsort(self.depth, kind="stable")
        bounds = np.searchsorted(self.depth[order], np.arange(self.depth.max(initial=0) + 2))
        return [order[bounds[d] : bounds[d + 1]] for d in range(len(bounds) - 1)]


@dataclasses.dataclass(frozen=True)
class Credit:
    """Per-node results of :func:`compute_credit` (edge quantities sit on the edge's child node).

    Attributes:
        mass: ω of each node; for a leaf it is the leaf weight w_ℓ, for an edge's child it is the segment mass W_e.
        value: V̂ of each node (0 at leaves).
        q: Q̂ of the edge into each node (0 at roots).
        segment_top: for each non-root node, the child node of its segment's first edge (-1 at roots).
        advantage: advantage credited to the turn entering each node: A of its segment, times γ^{t_u} under
            ``discount_weighting="exact"`` (0 at roots).
    """

    mass: np.ndarray
    value: np.ndarray
    q: np.ndarray
    segment_top: np.ndarray
    advantage: np.ndarray


def compute_credit(forest: Forest, config: BPOConfig = _DEFAULT, gamma: float = 1.0) -> Credit:
    """Masses, values, and sibling advantages of every node of ``forest``.

    ``config`` supplies the advantage options (``discount_weighting``, and the ablations ``mean_incl_self``,
    ``group_std`` and ``epsilon``);
    ``gamma`` is the discount per turn (verl's ``algorithm.gamma``).
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in (0, 1]; set algorithm.gamma")
    parent, k = forest.parent, forest.num_children
    levels = forest.levels()
    n = forest.size
    has_parent = parent >= 0

    mass = forest.masses()

    # Values, bottom-up: Q̂_c = r_c + γ V̂(c); V̂(u) = mean of its children's Q̂.
    value, q = np.zeros(n), np.zeros(n)
    q_sum, q_sqsum = np.zeros(n), np.zeros(n)
    for level in reversed(levels[1:]):
        q[level] = forest.reward[level] + gamma * value[level]
        np.add.at(q_sum, parent[level], q[level])
        np.add.at(q_sqsum, parent[level], q[level] ** 2)
        up = np.unique(parent[level])
        value[up] = q_sum[up] / k[up]

    # Segment tops, top-down: an edge starts a segment when its parent is a fork (or the root).
    segment_top = np.full(n, -1, dtype=np.int64)
    starts_segment = np.zeros(n, dtype=bool)
    starts_segment[has_parent] = (k[parent[has_parent]] >= 2) | (parent[parent[has_parent]] < 0)
    for level in levels[1:]:
        p = parent[level]
        segment_top[level] = np.where(starts_segment[level], level, segment_top[p])

    # Advantage of each segment's first edge against its siblings.
    top = np.flatnonzero(starts_segment)
    u = parent[top]
    k_u = k[u].astype(np.float64)
    group = k_u >= 2
    safe_k1 = np.where(group, k_u - 1, 1.0)
    if config.ablation.mean_incl_self:
        baseline = value[u]
    else:
        baseline = (q_sum[u] - q[top]) / safe_k1
    adv_top = np.where(group, q[top] - baseline, 0.0)
    if config.ablation.group_std:
        var = np.maximum(q_sqsum[u] - k_u * value[u] ** 2, 0.0) / safe_k1
        adv_top = adv_top / (np.sqrt(var) + config.ablation.epsilon)
    if config.discount_weighting == "exact" and gamma != 1.0:
        adv_top = adv_top * gamma ** forest.depth[u]
    adv_by_top = np.zeros(n)
    adv_by_top[top] = adv_top
    advantage = np.where(has_parent, adv_by_top[np.maximum(segment_top, 0)], 0.0)

    return Credit(mass, value, q, segment_top, advantage)


def paint_spans(
    shape: tuple[int, int],
    rows: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    *values: np.ndarray,
) -> list[np.ndarray]:
    """For each ``values`` array, paint ``values[j]`` on tokens ``[starts[j], ends[j])`` of row ``rows[j]``.

    Spans of a row must not overlap. Vectorised with an integer difference array and one cumulative sum (no loop
    over tokens): inside span j the running sum is j + 1, outside any span it is 0, so a gather reads each token's
    value exactly. Returns one ``shape`` float32 array per ``values`` (the dtype of verl's advantages).
    """
    batch, length = shape
    span_id = np.zeros((batch, length + 1), dtype=np.int32)
    marker = np.arange(1, len(rows) + 1, dtype=np.int32)
    np.add.at(span_id, (rows, starts), marker)
    np.add.at(span_id, (rows, ends), -marker)
    index = np.cumsum(span_id[:, :length], axis=1, dtype=np.int32)
    return [np.take(np.concatenate([[0.0], v]).astype(np.float32), index) for v in values]
