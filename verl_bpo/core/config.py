"""The ``bpo:`` config block: its dataclasses, their defaults, their meaning, their validation.

This is the single source of truth for every BPO setting. verl's hydra config takes its schema from here
(``verl_bpo.integration.settings`` registers it), the tree sampler, the fork policy and the estimator read it, and
the field table of docs/training.md is checked against it by the tests. The number of leaves per task is verl's own
``actor_rollout_ref.rollout.n`` (N, ``rollout_n`` below) and is passed alongside, never duplicated here. Pure
Python: no verl, no omegaconf.

The block is grouped by what reads it:

* :class:`BPOConfig` itself: the settings every run reads (tree or flat, the allocation, the paths, the sandbox
  faults, the advantage's discounting, training, the sandbox, the tree log);
* ``bpo.fixed.*`` (:class:`FixedAllocation`): read only under ``bpo.allocation=fixed``, the K0/K rule;
* ``bpo.learned.*`` (:class:`LearnedAllocation`): read only under ``bpo.allocation=learned``, the budget and the
  learned profile;
* ``bpo.ablation.*`` (:class:`Ablation`): biased ablations, all off by default.

A field the chosen allocation (or ablation) does not read is refused when set, so every setting that is accepted
changes something. Choices are enums whose member names equal their values (hydra matches enum overrides by name),
and ``str`` subclasses, so ``config.allocation == "fixed"`` holds.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Optional

__all__ = [
    "BPOConfig",
    "FixedAllocation",
    "LearnedAllocation",
    "Ablation",
    "SandboxSpec",
    "Mode",
    "Allocation",
    "BudgetUnit",
    "ForkScore",
    "Selector",
    "DiscountWeighting",
    "TREE_ESTIMATORS",
    "ROLLOUT_N",
]

# Estimators that consume the tree; under mode=auto every other estimator gets flat groups.
TREE_ESTIMATORS = frozenset({"bpo"})
ROLLOUT_N = "actor_rollout_ref.rollout.n"  # verl's key for N, named in every error about the leaf count


class _Choice(str, enum.Enum):
    """A choice of the ``bpo`` block. Formats as its value, so messages and logs read ``fixed``, not
    ``Allocation.fixed``."""

    def __str__(self) -> str:
        return self.value


class Mode(_Choice):
    auto = "auto"
    tree = "tree"
    flat = "flat"


class Allocation(_Choice):
    fixed = "fixed"
    learned = "learned"


class BudgetUnit(_Choice):
    leaves = "leaves"
    turns = "turns"
    tokens = "tokens"


class ForkScore(_Choice):
    parent_turn_surprisal = "parent_turn_surprisal"
    probe_surprisal = "probe_surprisal"
    next_token_entropy = "next_token_entropy"


class Selector(_Choice):
    topB_wave = "topB_wave"
    quantile = "quantile"


class DiscountWeighting(_Choice):
    segment = "segment"
    exact = "exact"


def _choice(kind: type[_Choice], value: Any, field: str) -> _Choice:
    """``value`` (a member or its name) as a member of ``kind``; an error names ``field`` and the valid values."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{field}={value!r} is not valid; use one of {[m.value for m in kind]}") from None


def _block(kind: type, value: Any, field: str) -> Any:
    """A sub-block given as a mapping (``from_mapping``, hydra's container) as its dataclass; an unknown key is an
    error that lists the valid ones."""
    if isinstance(value, kind):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{field} must be a mapping of its fields, got {value!r}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {field} key(s) {unknown}; valid keys: {sorted(known)}")
    return kind(**value)


def _changed(block: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of each field of ``block`` that differs from its default: the fields a user set."""
    default = type(block)()
    return [(f.name, getattr(block, f.name)) for f in dataclasses.fields(block)
            if getattr(block, f.name) != getattr(default, f.name)]


def _at_least(field: str, value: Any, low: float, null: str | None = None) -> None:
    """``value >= low`` (``None`` passes where ``null`` says what it means)."""
    if value is None and null is not None:
        return
    if value < low:
        raise ValueError(f"{field}={value} must be >= {low:g}" + (f" (or null for {null})" if null else ""))


@dataclasses.dataclass
class SandboxSpec:
    """Which sandbox a task runs in (``bpo.sandbox.*``; a dataset row's ``extra_info.sandbox`` overrides it).

    Parameters:
        name (`str`, defaults to `"smoke"`):
            Registry name (``smoke``, ``textworld``, ``alfworld``, ``swebench``, ``webshop`` or your own).
        config (`dict[str, Any]`, defaults to `{}`):
            Keys of that adapter's ``Config`` dataclass.
    """

    name: str = "smoke"
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FixedAllocation:
    """The fixed rule (``bpo.fixed.*``, read only under ``bpo.allocation=fixed``): a root fork of ``k0``, then
    forks of ``k`` placed by ``selector`` on ``score``, exactly N leaves (the ``leaves`` budget).

    Parameters:
        k (`int`, defaults to `2`):
            Children per fork below the root, K.
        k0 (`int` or `None`, defaults to `None`):
            Children of the root fork, K0; ``null`` = ``k``. ``k0 = rollout.n`` with no later fork is RLOO.
        score (`ForkScore`, defaults to `"parent_turn_surprisal"`):
            Fork score, higher = fork. ``parent_turn_surprisal`` (mean surprisal of the turn that led to the node,
            free), ``probe_surprisal`` (a discarded ``probe_tokens`` probe from the node), ``next_token_entropy``
            (needs a client that returns full next-token distributions; verl's servers do not).
        selector (`Selector`, defaults to `"topB_wave"`):
            ``topB_wave``: each wave forks the best-scoring nodes, filling the leaf budget whenever the horizon
            allows; ``quantile``: fork when the score reaches a threshold learned from earlier trees.
        max_forks_per_wave (`int` or `None`, defaults to `None`):
            Cap on forks decided in one wave; ``null`` = none.
        probe_tokens (`int`, defaults to `16`):
            Length of the discarded probe of ``score=probe_surprisal``.
    """

    k: int = 2
    k0: Optional[int] = None
    score: ForkScore = ForkScore.parent_turn_surprisal
    selector: Selector = Selector.topB_wave
    max_forks_per_wave: Optional[int] = None
    probe_tokens: int = 16

    def __post_init__(self) -> None:
        self.score = _choice(ForkScore, self.score, "bpo.fixed.score")
        self.selector = _choice(Selector, self.selector, "bpo.fixed.selector")
        if self.k < 2:
            raise ValueError(f"bpo.fixed.k={self.k} must be >= 2: a fork has at least two children")
        _at_least("bpo.fixed.k0", self.k0, 1, null="bpo.fixed.k")
        _at_least("bpo.fixed.max_forks_per_wave", self.max_forks_per_wave, 1, null="no cap")
        _at_least("bpo.fixed.probe_tokens", self.probe_tokens, 1)


@dataclasses.dataclass
class LearnedAllocation:
    """The learned allocation (``bpo.learned.*``, read only under ``bpo.allocation=learned``): every width (the
    root's included, up to all of the budget, where the tree becomes RLOO) follows a profile of where return
    variance is injected, learned from earlier finished trees (``verl_bpo.core.profile``); the first
    ``warmup_trees`` trees and an ``explore_share`` of later ones take a fixed, score-independent exploration shape
    (root paths that fill the budget on average, each forking once into 2 at a uniformly drawn depth). No fork score
    is read.

    Parameters:
        budget_unit (`BudgetUnit`, defaults to `"turns"`):
            What a tree may spend. ``turns``: the generated turns N flat rollouts of this task would take: N times
            the task's episode as its last tree measured it, scaled by how the sandbox's average episode changed
            since (for a task not seen yet, N times the sandbox's average episode over recent trees); ``tokens``:
            their generated tokens; ``leaves``: at most N leaves (what a path that ends early leaves unspent goes
            to the branches still running). A dataset row's ``extra_info.bpo_budget`` (in this unit) replaces the
            learned amount for its task's tree.
        max_leaves (`int` or `None`, defaults to `None`):
            The most leaves a turn- or token-budget tree may grow (the sessions verl runs per task, so the
            trainer's rows per task at most); ``null`` = 4 · N.
        warmup_trees (`int`, defaults to `32`):
            The run's first training trees, of exploration shape, before the profile decides (validation never
            counts). Counted at each step's start: every tree of a step explores while fewer than this many trees
            were learned from before it.
        explore_share (`float`, defaults to `0.05`):
            Share of later trees grown with the exploration shape, so a profile that went flat can still notice
            when training moves the decisive turns.
        profile_prior (`float`, defaults to `0.1`):
            κ, the share of a depth's injected variance credited one depth earlier (returns cannot tell where the
            decisive action's expected gradient changes; this is a prior).
        profile_window (`int`, defaults to `500`):
            Trees after which an observation's weight in the profile's variogram (where outcomes are decided)
            falls to 1/e.
        cost_window (`int`, defaults to `16`):
            The same for what the profile learns of the current policy's episodes: their survival per depth, turn
            lengths and token probabilities. Each tree measures them well, and a tree budgeted on a stale length
            overspends (a policy whose turns grew 2x gets about 2x too many branches), so they follow the policy
            faster than the variogram.
    """

    budget_unit: BudgetUnit = BudgetUnit.turns
    max_leaves: Optional[int] = None
    warmup_trees: int = 32
    explore_share: float = 0.05
    profile_prior: float = 0.1
    profile_window: int = 500
    cost_window: int = 16

    def __post_init__(self) -> None:
        self.budget_unit = _choice(BudgetUnit, self.budget_unit, "bpo.learned.budget_unit")
        if self.max_leaves is not None and self.budget_unit == BudgetUnit.leaves:
            raise ValueError(f"bpo.learned.max_leaves={self.max_leaves} is ignored under bpo.learned.budget_unit="
                             "leaves, which grows at most N leaves; remove it or set bpo.learned.budget_unit to "
                             "turns or tokens")
        _at_least("bpo.learned.max_leaves", self.max_leaves, 2, null=f"4 x {ROLLOUT_N}")
        if not 0.0 <= self.explore_share <= 1.0:
            raise ValueError(f"bpo.learned.explore_share={self.explore_share} must be in [0, 1]")
        for field in ("warmup_trees", "profile_prior"):
            _at_least(f"bpo.learned.{field}", getattr(self, field), 0)
        for field in ("profile_window", "cost_window"):
            _at_least(f"bpo.learned.{field}", getattr(self, field), 1)


@dataclasses.dataclass
class Ablation:
    """Biased ablations (``bpo.ablation.*``), all off by default; the defaults are the unbiased production choices
    (leave-one-out baseline, no scaling, a non-anticipating fork score).

    Parameters:
        kept_turn_surprisal (`bool`, defaults to `False`):
            Fork on the mean surprisal of the node's own kept turn, drawn before the fork is decided: anticipating,
            so the kept child is no sample of the policy's distribution (posthoc forking). Replaces
            ``bpo.fixed.score``; fixed allocation only (learned plans read no fork score).
        mean_incl_self (`bool`, defaults to `False`):
            Baseline on the mean of all siblings including the turn itself (GRPO's choice), not on the other
            siblings' mean (leave-one-out, independent of the turn's own action, so the gradient is unbiased).
        group_std (`bool`, defaults to `False`):
            Divide each advantage by its siblings' standard deviation, as GRPO does (biased; Dr. GRPO,
            arXiv:2503.20783).
        epsilon (`float`, defaults to `1e-6`):
            Added to the standard deviation under ``group_std`` (verl's GRPO value); only meaningful with it.
    """

    kept_turn_surprisal: bool = False
    mean_incl_self: bool = False
    group_std: bool = False
    epsilon: float = 1e-6

    def __post_init__(self) -> None:
        if self.epsilon < 0:
            raise ValueError(f"bpo.ablation.epsilon={self.epsilon} must be >= 0")
        if not self.group_std and self.epsilon != Ablation.epsilon:
            raise ValueError(f"bpo.ablation.epsilon={self.epsilon} is ignored without bpo.ablation.group_std=true; "
                             "remove it or set bpo.ablation.group_std=true")


@dataclasses.dataclass
class BPOConfig:
    """Branching Policy Optimization settings (``bpo.<field>=...`` on the command line). N below is
    ``actor_rollout_ref.rollout.n``, the rollouts a flat group would take.

    Parameters:
        > Tree shape

        mode (`Mode`, defaults to `"auto"`):
            ``auto``: a tree when ``algorithm.adv_estimator=bpo``, flat groups (N independent rollouts through the
            same sampler) for every other estimator; ``tree`` or ``flat`` force one.
        allocation (`Allocation`, defaults to `"fixed"`):
            How fork widths are chosen. ``fixed``: the K0/K rule of ``bpo.fixed``, exactly N leaves. ``learned``:
            every width from a learned profile, within the budget of ``bpo.learned``. The other block is not read,
            and setting one of its fields is an error.
        min_depth (`int`, defaults to `1`):
            No fork before this many turns (the root fork is always made).
        max_forks_per_path (`int` or `None`, defaults to `None`):
            Cap on forks along one root-to-leaf path, the root fork excluded; ``null`` = none.
        cooldown (`int`, defaults to `0`):
            No fork within this many turns after a fork on the same path.

        > Paths

        max_turns (`int`, defaults to `8`):
            Turns after which a path is cut (a truncated leaf).
        max_tokens_per_turn (`int` or `None`, defaults to `None`):
            Cap on one turn's generated tokens; ``null`` = the rest of ``rollout.response_length``.
        step_timeout_s (`float`, defaults to `60.0`):
            A sandbox reset, step or restore slower than this fails (a step is then retried, below).
        step_retries (`int`, defaults to `2`):
            Times a sandbox step that crashed or timed out is retried: on a fresh sandbox rebuilt at the state
            before the step (restored from a snapshot taken before it where snapshots are cheap, ``native`` and
            ``replay``, else from the branch's last fork snapshot with the actions since replayed), re-seeded, with
            the same action text, so a transient fault leaves the path distributed as without it. 0 = end the leaf
            at the first fault.
        mask_failed_turns (`bool`, defaults to `True`):
            A turn whose sandbox step still crashed or timed out after ``step_retries`` retries is masked out of the
            loss (its tokens get ``response_mask = 0``), so an infrastructure fault never becomes a negative sample
            for what the model said. The leaf keeps the rewards its earlier turns earned, and its mass.

        > Advantage (``gamma`` is verl's ``algorithm.gamma``; the baseline and scale are in ``bpo.ablation``)

        discount_weighting (`DiscountWeighting`, defaults to `"segment"`):
            ``segment`` drops the state weight γ^t of a fork at depth t, the approximation PPO and GRPO make;
            ``exact`` keeps it (the exact discounted policy gradient).

        > Training

        packed (`bool`, defaults to `True`):
            The actor trains each tree as one packed row of its unique tokens (``verl_bpo.core.packing``): a token
            above a fork is forwarded and back-propagated once, not once per leaf below it, with the same loss and
            gradient as one row per leaf. ``false`` trains one row per leaf (for comparison). Needs
            ``attn_implementation`` sdpa or a flash-attention kernel, the ``vanilla`` policy loss and no Ulysses
            sequence parallelism (refused before Ray otherwise).
        sandbox (`SandboxSpec`, defaults to `smoke` with no config):
            The default sandbox (:class:`SandboxSpec`).
        tree_log (`str` or `None`, defaults to `None`):
            A JSON-lines file the trainer appends a line to per training step: the step's first tree (its leaves'
            metadata, returns, outcomes and the tree's metrics), for pictures and debugging, and under ``trees``
            what every tree of the step spent on which task (uid, the row's task, generated tokens, environment
            steps, and the budget of a budgeted tree), under any estimator; ``null`` = none.

        > Blocks

        fixed (`FixedAllocation`): ``bpo.fixed.*``, read only under ``allocation=fixed``.
        learned (`LearnedAllocation`): ``bpo.learned.*``, read only under ``allocation=learned``.
        ablation (`Ablation`): ``bpo.ablation.*``, biased ablations, all off by default.
    """

    mode: Mode = Mode.auto
    allocation: Allocation = Allocation.fixed
    min_depth: int = 1
    max_forks_per_path: Optional[int] = None
    cooldown: int = 0
    max_turns: int = 8
    max_tokens_per_turn: Optional[int] = None
    step_timeout_s: float = 60.0
    step_retries: int = 2
    mask_failed_turns: bool = True
    discount_weighting: DiscountWeighting = DiscountWeighting.segment
    packed: bool = True
    sandbox: SandboxSpec = dataclasses.field(default_factory=SandboxSpec)
    tree_log: Optional[str] = None
    fixed: FixedAllocation = dataclasses.field(default_factory=FixedAllocation)
    learned: LearnedAllocation = dataclasses.field(default_factory=LearnedAllocation)
    ablation: Ablation = dataclasses.field(default_factory=Ablation)

    def __post_init__(self) -> None:
        self.mode = _choice(Mode, self.mode, "bpo.mode")
        self.allocation = _choice(Allocation, self.allocation, "bpo.allocation")
        self.discount_weighting = _choice(DiscountWeighting, self.discount_weighting, "bpo.discount_weighting")
        self.sandbox = _block(SandboxSpec, self.sandbox, "bpo.sandbox")
        self.fixed = _block(FixedAllocation, self.fixed, "bpo.fixed")
        self.learned = _block(LearnedAllocation, self.learned, "bpo.learned")
        self.ablation = _block(Ablation, self.ablation, "bpo.ablation")
        # A field the allocation does not read would be silently ignored; refuse it so that every accepted setting
        # changes the run.
        unread, other = ("learned", self.learned) if self.allocation == Allocation.fixed else ("fixed", self.fixed)
        changed = _changed(other)
        if changed:
            name, value = changed[0]
            raise ValueError(f"bpo.{unread}.{name}={value} is ignored under bpo.allocation={self.allocation}; "
                             f"remove it or set bpo.allocation={unread}")
        if self.ablation.kept_turn_surprisal:
            if self.allocation == Allocation.learned:
                raise ValueError("bpo.ablation.kept_turn_surprisal=true is ignored under bpo.allocation=learned "
                                 "(learned plans read no fork score); remove it or set bpo.allocation=fixed")
            if self.fixed.score != FixedAllocation.score:
                raise ValueError(f"bpo.fixed.score={self.fixed.score} is ignored under "
                                 "bpo.ablation.kept_turn_surprisal=true, which forks on the kept turn's surprisal; "
                                 "remove one of them")
        for field in ("min_depth", "cooldown"):
            _at_least(f"bpo.{field}", getattr(self, field), 0)
        _at_least("bpo.max_forks_per_path", self.max_forks_per_path, 1, null="no cap")
        _at_least("bpo.max_tokens_per_turn", self.max_tokens_per_turn, 1, null="no cap")
        _at_least("bpo.max_turns", self.max_turns, 1)
        if not self.step_timeout_s > 0:
            raise ValueError(f"bpo.step_timeout_s={self.step_timeout_s} must be > 0")
        if self.step_retries < 0:
            raise ValueError(f"bpo.step_retries={self.step_retries} must be >= 0 (0 ends a leaf at its first sandbox "
                             "fault); set bpo.step_retries=2, the default")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> BPOConfig:
        """From a plain mapping (the ``bpo`` block, sub-blocks as mappings); an unknown key, in the block or in
        any sub-block, is an error that lists the valid ones."""
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown bpo config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**raw)

    # --- the tree this config grows for N = rollout_n -----------------------------------------------------------
    def for_estimator(self, estimator: str) -> BPOConfig:
        """``mode=auto`` resolved for ``algorithm.adv_estimator``: ``tree`` for bpo, ``flat`` for the baselines."""
        if self.mode != Mode.auto:
            return self
        return dataclasses.replace(self, mode=Mode.tree if estimator in TREE_ESTIMATORS else Mode.flat)

    def is_flat(self, rollout_n: int) -> bool:
        """N independent rollouts: flat mode, a single leaf (validation, ``val_kwargs.n=1``), or under the fixed
        rule a root fork of N (the learned allocation reads no ``k`` or ``k0``)."""
        if self.mode == Mode.auto:
            raise ValueError("resolve bpo.mode=auto with for_estimator() first")
        if self.mode == Mode.flat or rollout_n < 2:
            return True
        return self.allocation == Allocation.fixed and self.root_width(rollout_n) >= rollout_n

    def root_width(self, rollout_n: int) -> int:
        """K0 for N leaves: N in flat mode, else ``fixed.k0`` (default ``fixed.k``), never more than N."""
        if self.mode == Mode.flat:
            return rollout_n
        return min(self.fixed.k if self.fixed.k0 is None else self.fixed.k0, rollout_n)

    def leaf_cap(self, rollout_n: int) -> int:
        """The most leaves a tree grows: N under a leaf budget (the fixed rule's, in flat mode, or
        ``learned.budget_unit=leaves``), else ``learned.max_leaves`` (default 4 · N)."""
        if (self.mode == Mode.flat or self.allocation == Allocation.fixed
                or self.learned.budget_unit == BudgetUnit.leaves):
            return rollout_n
        return self.learned.max_leaves if self.learned.max_leaves is not None else 4 * rollout_n

    def check_leaves(self, rollout_n: int) -> None:
        """Errors about N name verl's key, since that is where users set it."""
        if rollout_n < 1:
            raise ValueError(f"{ROLLOUT_N}={rollout_n} must be >= 1")
        if self.mode == Mode.flat:
            return
        if self.fixed.k0 is not None and self.fixed.k0 > rollout_n:
            raise ValueError(f"bpo.fixed.k0={self.fixed.k0} exceeds {ROLLOUT_N}={rollout_n}, the leaves per tree; "
                             f"set bpo.fixed.k0 <= {rollout_n}")
        if self.leaf_cap(rollout_n) < rollout_n:
            raise ValueError(f"bpo.learned.max_leaves={self.learned.max_leaves} is below {ROLLOUT_N}={rollout_n}; "
                             f"a turn or token budget needs room for at least N leaves")

    @property
    def anticipating(self) -> bool:
        """True for the biased posthoc ablation: the fork is decided after the node's kept turn is drawn."""
        return self.ablation.kept_turn_surprisal
