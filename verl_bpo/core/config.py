"""The ``bpo:`` config block: one dataclass, its defaults, its meaning, its validation.

This is the single source of truth for every BPO setting. verl's hydra config takes its schema from here
(``verl_bpo.integration.config`` registers it), the tree sampler, the fork policy and the estimator read it, and
the field table of docs/training.md is checked against it by the tests. The number of leaves per task is verl's own
``actor_rollout_ref.rollout.n`` and is passed alongside, never duplicated here. Pure Python: no verl, no omegaconf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

__all__ = [
    "BPOConfig",
    "SandboxSpec",
    "MODES",
    "ALLOCATIONS",
    "BUDGETS",
    "SCORES",
    "SELECTORS",
    "TREE_ESTIMATORS",
    "ROLLOUT_N",
]

MODES = ("auto", "tree", "flat")
ALLOCATIONS = ("fixed", "learned")
BUDGETS = ("leaves", "turns", "tokens")
SCORES = ("parent_turn_surprisal", "probe_surprisal", "next_token_entropy", "kept_turn_surprisal")
ANTICIPATING_SCORES = frozenset({"kept_turn_surprisal"})
SELECTORS = ("topB_wave", "quantile")
BASELINES = ("loo", "mean_incl_self")
SCALES = ("none", "group_std")
DISCOUNT_WEIGHTINGS = ("segment", "exact")
# Estimators that consume the tree; under mode=auto every other estimator gets flat groups.
TREE_ESTIMATORS = frozenset({"bpo"})
ROLLOUT_N = "actor_rollout_ref.rollout.n"  # verl's key for N, named in every error about the leaf count


@dataclasses.dataclass
class SandboxSpec:
    """Which sandbox a task runs in (a dataset row's ``extra_info.sandbox`` overrides it).

    Attributes:
        name: registry name (``smoke``, ``textworld``, ``alfworld``, ``swebench``, ``webshop`` or your own).
            Default ``smoke``.
        config: keys of that adapter's ``Config`` dataclass. Default ``{}``.
    """

    name: str = "smoke"
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BPOConfig:
    """Branching Policy Optimization settings (``bpo.<field>=...`` on the command line).

    Tree shape (N = ``actor_rollout_ref.rollout.n``, the rollouts a flat group would take):
        mode: ``auto`` (default): a tree when ``algorithm.adv_estimator=bpo``, flat groups (N independent rollouts
            through the same sampler) for every other estimator; ``tree`` or ``flat`` force one.
        allocation: how fork widths are chosen. ``fixed`` (default): a root fork of ``k0`` and forks of ``k`` placed
            by ``selector`` on ``score``, exactly N leaves. ``learned``: every width (the root's included, up to all
            of the budget, where the tree becomes RLOO) follows a profile of where return variance is injected,
            learned from earlier finished trees (``verl_bpo.core.profile``); the first ``warmup_trees`` trees and an
            ``explore_share`` of later ones take a fixed, score-independent exploration shape (root paths that fill
            the budget on average, each forking once into 2 at a uniformly drawn depth).
        budget: what a ``learned`` tree may spend. ``turns`` (the default under ``learned``): the generated turns
            N flat rollouts of this task would take: N times the task's episode as its last tree measured it,
            scaled by how the sandbox's average episode changed since (for a task not seen yet, N times the
            sandbox's average episode over recent trees); ``tokens``: their generated tokens; ``leaves``: at most N
            leaves (what a path that ends early leaves unspent goes to the branches still running). A dataset
            row's ``extra_info.bpo_budget`` (in this unit) replaces the learned amount for its task's tree. A
            ``fixed`` tree always has the ``leaves`` budget, exactly N leaves.
        max_leaves: the most leaves a turn- or token-budget tree may grow (the sessions verl runs per task, so
            the trainer's rows per task at most); ``null`` (default) = 4 · N.
        warmup_trees: the run's first training trees, of exploration shape, before the profile decides
            (``learned``; validation never counts). Counted at each step's start: every tree of a step explores
            while fewer than this many trees were learned from before it. Default 32.
        explore_share: share of later trees grown with the exploration shape, so a profile that went flat can
            still notice when training moves the decisive turns. Default 0.05.
        profile_prior: κ, the share of a depth's injected variance credited one depth earlier (returns cannot tell
            where the decisive action's expected gradient changes; this is a prior). Default 0.1.
        profile_window: trees after which an observation's weight in the profile's variogram (where outcomes are
            decided) falls to 1/e. Default 500.
        cost_window: the same for what the profile learns of the current policy's episodes: their survival per
            depth, turn lengths and token probabilities. Each tree measures them well, and a tree budgeted on a
            stale length overspends (a policy whose turns grew 2x gets about 2x too many branches), so they follow
            the policy faster than the variogram. Default 16.
        k: children per fork below the root, K. Default 2.
        k0: children of the root fork, K0; ``null`` = ``k``. ``k0 = rollout.n`` with no later fork is RLOO.
        score: fork score, higher = fork. ``parent_turn_surprisal`` (default; mean surprisal of the turn that led
            to the node, free), ``probe_surprisal`` (a discarded ``probe_tokens`` probe from the node),
            ``next_token_entropy`` (needs a client that returns full next-token distributions; verl's servers do
            not), ``kept_turn_surprisal`` (the node's own kept turn decides: anticipating, a biased ablation).
        selector: ``topB_wave`` (default; each wave forks the best-scoring nodes, filling the leaf budget whenever
            the horizon allows) or ``quantile`` (fork when the score reaches a threshold learned from earlier trees).
        max_forks_per_wave: cap on forks decided in one wave; ``null`` (default) = none.
        min_depth: no fork before this many turns. Default 1 (the root fork is always made).
        max_forks_per_path: cap on forks along one root-to-leaf path, the root fork excluded; ``null`` = none.
        cooldown: no fork within this many turns after a fork on the same path. Default 0.

    Paths:
        max_turns: turns after which a path is cut (a truncated leaf). Default 8.
        max_tokens_per_turn: cap on one turn's generated tokens; ``null`` (default) = the rest of
            ``rollout.response_length``.
        probe_tokens: length of the discarded probe of ``score=probe_surprisal``. Default 16.
        step_timeout_s: a sandbox reset, step or restore slower than this fails (a step is then retried, below).
            Default 60.
        step_retries: times a sandbox step that crashed or timed out is retried: on a fresh sandbox rebuilt at the
            state before the step (restored from a snapshot taken before it where snapshots are cheap, ``native``
            and ``replay``, else from the branch's last fork snapshot with the actions since replayed), re-seeded,
            with the same action text, so a transient fault leaves the path distributed as without it. 0 = end
            the leaf at the first fault. Default 2.
        mask_failed_turns: a turn whose sandbox step still crashed or timed out after ``step_retries`` retries is
            masked out of the loss (its tokens get ``response_mask = 0``), so an infrastructure fault never becomes
            a negative sample for what the model said. The leaf keeps the rewards its earlier turns earned, and its
            mass. Default true.

    Advantage (``gamma`` is verl's ``algorithm.gamma``):
        baseline: ``loo`` (default): mean of the other siblings' returns, independent of the turn's own action,
            so the gradient is unbiased; ``mean_incl_self``: all siblings including itself (GRPO's choice).
        scale: ``none`` (default) or ``group_std``: divide by the siblings' standard deviation, as GRPO does
            (biased; Dr. GRPO, arXiv:2503.20783).
        discount_weighting: ``segment`` (default) drops the state weight γ^t of a fork at depth t, the
            approximation PPO and GRPO make; ``exact`` keeps it (the exact discounted policy gradient).
        epsilon: added to the standard deviation under ``scale=group_std``. Default 1e-6 (verl's GRPO value).

    Training:
        packed: the actor trains each tree as one packed row of its unique tokens (``verl_bpo.core.packing``): a
            token above a fork is forwarded and back-propagated once, not once per leaf below it, with the same
            loss and gradient as one row per leaf. ``false`` trains one row per leaf (for comparison). Needs
            ``attn_implementation`` sdpa or a flash-attention kernel, the ``vanilla`` policy loss and no Ulysses
            sequence parallelism (refused before Ray otherwise). Default true.

    sandbox: the default :class:`SandboxSpec`.
    tree_log: a JSON-lines file the trainer appends a line to per training step: the step's first tree (its leaves'
        metadata, returns, outcomes and the tree's metrics), for pictures and debugging, and under ``trees`` what
        every tree of the step spent on which task (uid, the row's task, generated tokens, environment steps, and
        the budget of a budgeted tree), under any estimator; ``null`` (default) = none.
    """

    mode: str = "auto"
    allocation: str = "fixed"
    budget: Optional[str] = None
    max_leaves: Optional[int] = None
    warmup_trees: int = 32
    explore_share: float = 0.05
    profile_prior: float = 0.1
    profile_window: int = 500
    cost_window: int = 16
    k: int = 2
    k0: Optional[int] = None
    score: str = "parent_turn_surprisal"
    selector: str = "topB_wave"
    max_forks_per_wave: Optional[int] = None
    min_depth: int = 1
    max_forks_per_path: Optional[int] = None
    cooldown: int = 0
    max_turns: int = 8
    max_tokens_per_turn: Optional[int] = None
    probe_tokens: int = 16
    step_timeout_s: float = 60.0
    step_retries: int = 2
    mask_failed_turns: bool = True
    baseline: str = "loo"
    scale: str = "none"
    discount_weighting: str = "segment"
    epsilon: float = 1e-6
    packed: bool = True
    sandbox: SandboxSpec = dataclasses.field(default_factory=SandboxSpec)
    tree_log: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.sandbox, Mapping):
            self.sandbox = SandboxSpec(**self.sandbox)
        if self.budget is None:
            self.budget = "turns" if self.allocation == "learned" else "leaves"
        for field, allowed in (("mode", MODES), ("allocation", ALLOCATIONS), ("budget", BUDGETS),
                               ("score", SCORES), ("selector", SELECTORS),
                               ("baseline", BASELINES), ("scale", SCALES),
                               ("discount_weighting", DISCOUNT_WEIGHTINGS)):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"bpo.{field}={value!r} is not valid; use one of {list(allowed)}")
        if self.allocation == "fixed" and self.budget != "leaves":
            raise ValueError(f"bpo.budget={self.budget} needs bpo.allocation=learned; the fixed rule grows exactly "
                             "N leaves (bpo.budget=leaves)")
        if not 0.0 <= self.explore_share <= 1.0:
            raise ValueError(f"bpo.explore_share={self.explore_share} must be in [0, 1]")
        for field in ("warmup_trees", "profile_prior"):
            if getattr(self, field) < 0:
                raise ValueError(f"bpo.{field}={getattr(self, field)} must be >= 0")
        for field in ("profile_window", "cost_window"):
            if getattr(self, field) < 1:
                raise ValueError(f"bpo.{field}={getattr(self, field)} must be >= 1")
        if self.max_leaves is not None and self.max_leaves < 2:
            raise ValueError(f"bpo.max_leaves={self.max_leaves} must be >= 2 (or null for 4 x rollout.n)")
        if self.k < 2:
            raise ValueError(f"bpo.k={self.k} must be >= 2: a fork has at least two children")
        if self.k0 is not None and self.k0 < 1:
            raise ValueError(f"bpo.k0={self.k0} must be >= 1 (or null for bpo.k)")
        for field in ("min_depth", "cooldown"):
            if getattr(self, field) < 0:
                raise ValueError(f"bpo.{field}={getattr(self, field)} must be >= 0")
        for field in ("max_forks_per_wave", "max_forks_per_path", "max_tokens_per_turn"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"bpo.{field}={value} must be >= 1 (or null for no cap)")
        if self.max_turns < 1:
            raise ValueError(f"bpo.max_turns={self.max_turns} must be >= 1")
        if self.probe_tokens < 1:
            raise ValueError(f"bpo.probe_tokens={self.probe_tokens} must be >= 1")
        if not self.step_timeout_s > 0:
            raise ValueError(f"bpo.step_timeout_s={self.step_timeout_s} must be > 0")
        if self.step_retries < 0:
            raise ValueError(f"bpo.step_retries={self.step_retries} must be >= 0 (0 ends a leaf at its first sandbox "
                             "fault); set bpo.step_retries=2, the default")
        if self.epsilon < 0:
            raise ValueError(f"bpo.epsilon={self.epsilon} must be >= 0")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> BPOConfig:
        """From a plain mapping (the ``bpo`` block); an unknown key is an error that lists the valid ones."""
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown bpo config key(s) {unknown}; valid keys: {sorted(known)}")
        sandbox = raw.get("sandbox")
        if sandbox is not None and not isinstance(sandbox, (Mapping, SandboxSpec)):
            raise ValueError(f"bpo.sandbox must be a mapping with name and config, got {sandbox!r}")
        if isinstance(sandbox, Mapping):
            unknown = sorted(set(sandbox) - {"name", "config"})
            if unknown:
                raise ValueError(f"unknown bpo.sandbox key(s) {unknown}; valid keys: ['config', 'name']")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --- the tree this config grows for N leaves ------------------------------------------------------------
    def for_estimator(self, estimator: str) -> BPOConfig:
        """``mode=auto`` resolved for ``algorithm.adv_estimator``: ``tree`` for bpo, ``flat`` for the baselines."""
        if self.mode != "auto":
            return self
        return dataclasses.replace(self, mode="tree" if estimator in TREE_ESTIMATORS else "flat")

    def is_flat(self, n_leaves: int) -> bool:
        """N independent rollouts: flat mode, a single leaf (validation, ``val_kwargs.n=1``), or under the fixed
        rule a root fork of N (the learned allocation ignores ``k`` and ``k0``)."""
        if self.mode == "auto":
            raise ValueError("resolve bpo.mode=auto with for_estimator() first")
        if self.mode == "flat" or n_leaves < 2:
            return True
        return self.allocation == "fixed" and self.root_width(n_leaves) >= n_leaves

    def root_width(self, n_leaves: int) -> int:
        """K0 for N leaves: N in flat mode, else ``k0`` (default ``k``), never more than N."""
        if self.mode == "flat":
            return n_leaves
        return min(self.k if self.k0 is None else self.k0, n_leaves)

    def leaf_cap(self, n_leaves: int) -> int:
        """The most leaves a tree grows: N under the leaf budget (and in flat mode), else ``max_leaves``."""
        if self.mode == "flat" or self.budget == "leaves":
            return n_leaves
        return self.max_leaves if self.max_leaves is not None else 4 * n_leaves

    def check_leaves(self, n_leaves: int) -> None:
        """Errors about N name verl's key, since that is where users set it."""
        if n_leaves < 1:
            raise ValueError(f"{ROLLOUT_N}={n_leaves} must be >= 1")
        if self.mode != "flat" and self.k0 is not None and self.k0 > n_leaves:
            raise ValueError(f"bpo.k0={self.k0} exceeds {ROLLOUT_N}={n_leaves}, the leaves per tree; "
                             f"set bpo.k0 <= {n_leaves}")
        if self.mode != "flat" and self.budget != "leaves" and self.leaf_cap(n_leaves) < n_leaves:
            raise ValueError(f"bpo.max_leaves={self.max_leaves} is below {ROLLOUT_N}={n_leaves}; a turn or token "
                             f"budget needs room for at least N leaves")

    @property
    def anticipating(self) -> bool:
        """True for the biased posthoc ablation: the fork is decided after the node's kept turn is drawn."""
        return self.score in ANTICIPATING_SCORES
