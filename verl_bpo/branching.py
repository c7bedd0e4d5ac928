"""Where to fork: the leaf budget, the non-anticipating fork rule, fork scores and selectors (spec §3.3).

**Invariant (non-anticipation).** Whether node v forks, and into how many children, may depend only on what is
known before v's children are sampled: v's own history, discarded probes, other subtrees, earlier trees. Score
functions therefore receive a frozen :class:`NodeView` of the node alone. If the invariant holds the choice of score
changes efficiency only, never bias (§3.7). ``S4`` (the surprisal of the kept turn, ARPO/TreeRL style) breaks it
and is offered as a documented, biased ablation only.

Fork scores (per node v, higher = more worth forking):
    S1 ``next_token_entropy``: entropy of the first free next-token distribution at h_v.
    S2 ``probe_surprisal``: mean surprisal of a short, discarded probe continuation from h_v.
    S3 ``parent_turn_surprisal``: mean surprisal of the turn that led into v (free: rollout log-probs).
    S4 ``kept_turn_surprisal``: mean surprisal of v's own kept turn — decided after the fact, BIASED.

Selectors (both keep the invariant):
    ``topB_wave``: all paths advance one turn per wave; at each wave rank the pending nodes and fork the best,
        up to the remaining budget and ``max_forks_per_wave``.
    ``quantile``: fork iff the score reaches τ, the (1 − ρ) quantile of the previous tree's candidate scores, with
        ρ chosen so the expected number of forks matches the budget. Works with asynchronous branches.
Limits (AEPO-style): ``min_depth``, ``max_forks_per_path``, ``cooldown`` turns between forks on one path, and at
least one turn of horizon left.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np

__all__ = [
    "SCORES",
    "BranchingConfig",
    "NodeView",
    "ForkBudget",
    "is_eligible",
    "TopBWave",
    "QuantileSelector",
    "make_selector",
]

SCORES = ("next_token_entropy", "probe_surprisal", "parent_turn_surprisal", "kept_turn_surprisal")
ANTICIPATING_SCORES = frozenset({"kept_turn_surprisal"})


@dataclasses.dataclass(frozen=True)
class BranchingConfig:
    """Tree shape and fork rule.

    Attributes:
        n_leaves: N, the leaves grown per task (verl's ``rollout.n``). Default 8.
        k: K, children per fork below the root. Default 2.
        k0: children of the root fork; ``None`` means ``k``. ``k0 = n_leaves`` with no further forks is flat mode
            (N independent rollouts: the GRPO/RLOO baseline through the same sampler).
        score: one of :data:`SCORES`. Default ``"parent_turn_surprisal"`` (S3, free).
        selector: ``"topB_wave"`` (default) or ``"quantile"``.
        max_forks_per_wave: cap on forks decided in one wave (``topB_wave``); ``None`` = no cap.
        min_depth: no fork before this many turns. Default 1 (the root fork is always made).
        max_forks_per_path: cap on forks along one root-to-leaf path, root excluded; ``None`` = no cap.
        cooldown: no fork within this many turns after a fork on the same path. Default 0.
    """

    n_leaves: int = 8
    k: int = 2
    k0: int | None = None
    score: str = "parent_turn_surprisal"
    selector: Literal["topB_wave", "quantile"] = "topB_wave"
    max_forks_per_wave: int | None = None
    min_depth: int = 1
    max_forks_per_path: int | None = None
    cooldown: int = 0

    def __post_init__(self) -> None:
        if self.n_leaves < 1:
            raise ValueError(f"bpo.n_leaves={self.n_leaves} must be >= 1 (set actor_rollout_ref.rollout.n)")
        if self.k < 2:
            raise ValueError(f"bpo.k={self.k} must be >= 2: a fork has at least two children")
        if self.k0 is not None and not 1 <= self.k0 <= self.n_leaves:
            raise ValueError(f"bpo.k0={self.k0} must be in [1, n_leaves={self.n_leaves}]")
        if self.score not in SCORES:
            raise ValueError(f"bpo.score={self.score!r} is not valid; use one of {list(SCORES)}")
        if self.selector not in ("topB_wave", "quantile"):
            raise ValueError(f"bpo.selector={self.selector!r} is not valid; use 'topB_wave' or 'quantile'")
        for name in ("min_depth", "cooldown"):
            if getattr(self, name) < 0:
                raise ValueError(f"bpo.{name}={getattr(self, name)} must be >= 0")

    @property
    def root_k(self) -> int:
        return min(self.k if self.k0 is None else self.k0, self.n_leaves)

    @property
    def anticipating(self) -> bool:
        """True for the biased posthoc ablation (S4): the fork is decided after the kept turn is sampled."""
        return self.score in ANTICIPATING_SCORES


@dataclasses.dataclass(frozen=True)
class NodeView:
    """The only thing a fork score may read: a node's own history, never anything below it.

    Attributes:
        node_id: the node's id within its tree.
        depth: turns from the root.
        history: the node's history h_v (token ids, or a state for tabular problems); immutable.
        parent_turn_surprisal: mean −log π of the turn that led here (S3); ``None`` at the root.
        forks_on_path: forks on the path from the root to here, the root fork excluded.
        turns_since_fork: turns since the last fork on this path (the root counts as a fork).
        horizon_left: turns the sandbox still allows on this path; ``None`` when unknown.
        extras: score-specific inputs computed before any child is sampled (S1 entropy, S2 probe).
    """

    node_id: int
    depth: int
    history: Hashable
    parent_turn_surprisal: float | None
    forks_on_path: int
    turns_since_fork: int
    horizon_left: int | None = None
    extras: tuple[tuple[str, Any], ...] = ()

    def extra(self, key: str, default: Any = None) -> Any:
        return dict(self.extras).get(key, default)


class ForkBudget:
    """Leaves still to be created: N − K0 after the root fork; a fork with K children uses K − 1."""

    def __init__(self, config: BranchingConfig) -> None:
        self.config = config
        self.leaves_left = config.n_leaves - config.root_k

    @property
    def forks_wanted(self) -> int:
        """Forks of K children the remaining budget allows (the last one may be smaller)."""
        return math.ceil(self.leaves_left / (self.config.k - 1))

    def children_for_fork(self, k: int | None = None) -> int:
        """Children the next fork gets: K, shortened to fill the budget exactly; 0 when nothing is left."""
        if self.leaves_left <= 0:
            return 0
        return min(self.config.k if k is None else k, self.leaves_left + 1)

    def spend(self, children: int) -> None:
        if not 2 <= children <= self.leaves_left + 1:
            raise ValueError(f"a fork of {children} children does not fit the {self.leaves_left} leaves left")
        self.leaves_left -= children - 1


def is_eligible(view: NodeView, config: BranchingConfig) -> bool:
    """AEPO-style limits: depth, forks per path, cooldown, and at least one turn of horizon left."""
    if view.depth < max(config.min_depth, 1):
        return False
    if config.max_forks_per_path is not None and view.forks_on_path >= config.max_forks_per_path:
        return False
    if view.turns_since_fork <= config.cooldown:
        return False
    return view.horizon_left is None or view.horizon_left >= 1


class TopBWave:
    """Fork the highest-scoring pending nodes of a wave, within the budget and ``max_forks_per_wave``."""

    def __init__(self, config: BranchingConfig) -> None:
        self.config = config

    def select(self, keys: Sequence[Hashable], scores: Sequence[float], budget: ForkBudget) -> list[Hashable]:
        # Stable ranking: ties keep the order the paths were created in.
        order = sorted(range(len(keys)), key=lambda i: -scores[i])
        cap = self.config.max_forks_per_wave
        picked, room = [], budget.leaves_left
        for i in order:
            if room <= 0 or (cap is not None and len(picked) >= cap):
                break
            picked.append(keys[i])
            room -= min(self.config.k - 1, room)
        return picked

    def end_tree(self, scores: Sequence[float], forks_wanted: int) -> None:
        """TopBWave keeps no state across trees."""


class QuantileSelector:
    """Fork iff the score reaches τ, the (1 − ρ) quantile of the previous tree's candidate scores.

    ρ = (forks the budget allows) / (candidates seen last tree), so the expected number of forks matches the
    budget. Before any tree has been seen, τ = −inf (fork the first eligible nodes, like ``topB_wave`` would).
    """

    def __init__(self, config: BranchingConfig) -> None:
        self.config = config
        self.threshold = -math.inf

    def select(self, keys: Sequence[Hashable], scores: Sequence[float], budget: ForkBudget) -> list[Hashable]:
        picked, room = [], budget.leaves_left
        for key, score in zip(keys, scores):
            if room <= 0:
                break
            if score >= self.threshold:
                picked.append(key)
                room -= min(self.config.k - 1, room)
        return picked

    def end_tree(self, scores: Sequence[float], forks_wanted: int) -> None:
        """Update τ from the finished tree's candidate scores (called between trees: never reads a live tree)."""
        if not scores:
            return
        rate = min(1.0, forks_wanted / len(scores))
        self.threshold = -math.inf if rate >= 1.0 else float(np.quantile(np.asarray(scores), 1.0 - rate))


def make_selector(config: BranchingConfig) -> TopBWave | QuantileSelector:
    return TopBWave(config) if config.selector == "topB_wave" else QuantileSelector(config)
