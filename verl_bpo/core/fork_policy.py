"""Where a tree forks and how wide: the non-anticipating fork rule, its limits, the tree's budget, and the plans.

**Invariant (non-anticipation).** Whether node v forks, and into how many children, may depend only on what is
known before v's children are sampled: v's own history and budget, discarded probes, other subtrees, earlier
trees, fresh randomness. A decision therefore reads a frozen :class:`NodeView` of the node alone. Under that
invariant the choice of rule changes efficiency, never bias: each child is a fresh sample of the node's action
and transitions, so the tree's Monte Carlo value at every node is unbiased (backward induction on depth), and the
mass ``Π 1/K`` of a leaf makes the tree's score-function sum an unbiased estimate of the policy gradient. Scoring a
node by its own kept turn (the posthoc fork of ARPO, arXiv:2507.19849, and TreeRL, arXiv:2506.11902) breaks it and
is offered as an ablation only.

Objects, from the longest-lived down:

* :class:`ForkPolicy` — what a run learns about where its trees should spend: the ``quantile`` threshold, the
  :class:`~verl_bpo.core.profile.DepthProfile`, each task's episode cost, and the count of trees that taught it.
  It learns only from finished trees' :class:`~verl_bpo.core.profile.TreeRecord` and its state is plain data
  (:meth:`ForkPolicy.state_dict`), so a run keeps exactly one: verl's trainer learns it from every tree of a step,
  whichever worker grew it, checkpoints it, and hands it to every worker with the next step's tasks.
* A :class:`Plan`, one per tree, made by :meth:`ForkPolicy.start_tree`: the tree sampler asks it which candidate
  nodes fork and how wide (:meth:`Plan.eligible`, :meth:`Plan.widths`) and keeps the tree's spending in its
  :class:`TreeBudget` (:attr:`Plan.budget`). Three plans implement it:

  - :class:`FixedPlan` (``bpo.allocation=fixed``): a root fork of K0, then forks of K within exactly N leaves,
    placed by a selector on a fork score. ``topB_wave`` ranks a wave's candidates and forks the best within the
    leaves left and ``max_forks_per_wave``; ``quantile`` forks a candidate whose score reaches τ, the (1 − ρ)
    quantile of the previous finished tree's candidate scores (ρ = forks the leaves allow / candidates seen;
    τ = −∞ at first).
  - :class:`AllocationPlan` (``learned``): every node takes the width of the shape that, under the learned
    profile, gives the least leave-one-out gradient variance within the amount it holds (:mod:`verl_bpo.core.shape`);
    a task decided by its first move gets the flat shape K0 = N (RLOO, which under the model it cannot do worse
    than).
  - :class:`ExplorePlan` (``learned``, warm-up and ``explore_share``): enough root paths to fill the budget on
    average (N/2 under a leaf budget), each forking once into 2 at the tree's one depth drawn uniformly,
    independent of any score; its leaf pairs teach the profile where outcomes split.

**The budget.** A tree's :class:`TreeBudget` counts one unit: ``leaves`` (the fixed rule, exactly N, and
``bpo.learned.budget_unit=leaves``), ``turns`` or ``tokens``. The root holds the tree's amount (``root_budget``)
and amounts flow down the tree: a fork splits its node's amount among its branches, a turn spends its cost, and
what a path leaves unspent when its episode ends goes to a pool that the branches still running share as they
reach their next node (the shape of a subtree may depend on other subtrees, never on its own children).
Separately, the leaf cap bounds the branches (N leaves under ``leaves``, ``bpo.learned.max_leaves`` otherwise): a
fork's new leaves count against it when the fork is decided. The fixed rule places its forks by the leaves left
under the cap, tree-wide (its amounts only keep the account); the learned allocation by the amount each node
holds, each node within its own share of the cap. Limits (AEPO-style,
arXiv:2510.14545): ``min_depth``, ``max_forks_per_path``, ``cooldown`` turns after a fork, and at least one turn of
horizon left.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import random
from collections.abc import Collection, Hashable, Sequence

import numpy as np

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.profile import DepthProfile, TreeRecord
from verl_bpo.core.shape import MAX_SEARCH_FORKS, best_shape, candidate_widths

__all__ = ["NodeView", "is_eligible", "TreeBudget", "Plan", "FixedPlan", "AllocationPlan", "ExplorePlan",
           "ForkPolicy"]


@dataclasses.dataclass(frozen=True)
class NodeView:
    """The only thing a fork decision may read: a node's own history and budget, never anything below it.

    Attributes:
        node_id: the node's id within its tree.
        depth: turns from the root.
        history: the node's history h_v (token ids, or a state for tabular problems); immutable.
        parent_turn_surprisal: mean −log π of the turn that led here; ``None`` at the root.
        forks_on_path: forks on the path from the root to here, the root fork excluded.
        turns_since_fork: turns since the last fork on this path (the root counts as a fork).
        horizon_left: turns the path may still take (``bpo.max_turns`` minus depth).
        budget: the amount the node's subtree may still spend, in the tree's :attr:`TreeBudget.unit`.
        mass: ω of the node, Π 1/K over the forks above it (1 at the root): its share of the tree.
    """

    node_id: int
    depth: int
    history: Hashable
    parent_turn_surprisal: float | None
    forks_on_path: int
    turns_since_fork: int
    horizon_left: int
    budget: float
    mass: float = 1.0


def is_eligible(view: NodeView, config: BPOConfig) -> bool:
    """AEPO-style limits: depth, forks per path, cooldown, and at least one turn of horizon left."""
    if view.depth < max(config.min_depth, 1):
        return False
    if config.max_forks_per_path is not None and view.forks_on_path >= config.max_forks_per_path:
        return False
    if view.turns_since_fork <= config.cooldown:
        return False
    return view.horizon_left >= 1


def _deal(total: float, parts: int) -> list[float]:
    """``total`` rounded to whole leaves, dealt into ``parts`` as evenly as they go (the first parts get one more)."""
    whole = int(round(total))
    return [float(whole // parts + (i < whole % parts)) for i in range(parts)]


class TreeBudget:
    """What one tree may spend, in one unit, and where it is (module docstring, "The budget").

    Args:
        unit: ``leaves``, ``turns`` or ``tokens``.
        root_budget: the root's amount: what the whole tree may spend.
        leaf_cap: the most leaves the tree may grow (the sessions verl runs for the task).

    Attributes:
        leaves: branches made, and reserved by forks decided but not yet made (1: the root path alone).
        pool: what ended branches left unspent, not yet shared among the branches still running. Under
            ``leaves`` a fork whose node holds fewer leaves than it made branches (the fixed rule forks by the cap,
            not by amounts) takes the rest from it, so it may dip below 0 until branches end.
        spent: turns or tokens spent so far (``leaves``: a leaf is spent by the branch that ends as it, so 0).
    """

    def __init__(self, unit: str, root_budget: float, leaf_cap: int) -> None:
        self.unit, self.root_budget, self.leaf_cap = unit, float(root_budget), leaf_cap
        self.leaves = 1
        self.pool = 0.0
        self.spent = 0.0

    @property
    def leaves_left(self) -> int:
        """Leaves the cap still allows."""
        return self.leaf_cap - self.leaves

    def reserve(self, children: int) -> None:
        """A fork of ``children`` branches (the original included) is decided: its new leaves count against the cap
        now, so branches that decide while it is still restoring stay within the cap."""
        if not 1 <= children <= self.leaves_left + 1:
            raise ValueError(f"a fork of {children} children does not fit the {self.leaves_left} leaves left")
        self.leaves += children - 1

    def on_fork(self, amount: float, planned: int, made: int) -> list[float]:
        """The amounts of a fork's ``made`` branches (the original first), from its node's ``amount``. The fork was
        reserved as ``planned``; fewer are made when snapshots or restores fail, and the rest return to the cap."""
        self.leaves -= planned - made
        if self.unit != "leaves":
            return [amount / made] * made
        short = made - int(round(amount))  # every branch holds at least the leaf it will end as
        if short > 0:
            self.pool -= short
            amount += short
        return _deal(amount, made)

    def on_node(self, amount: float, running: int) -> float:
        """The amount of a branch about to decide at its next node: its own, and its share of the pool among the
        ``running`` branches."""
        if self.pool <= 0:
            return amount
        extra = _deal(self.pool, running)[0] if self.unit == "leaves" else self.pool / running
        self.pool -= extra
        return amount + extra

    def on_turn(self, amount: float, tokens: int) -> float:
        """A branch's amount after a turn that generated ``tokens``: less the turn's cost (1 turn, ``tokens``
        tokens, no leaves)."""
        cost = {"leaves": 0.0, "turns": 1.0, "tokens": float(tokens)}[self.unit]
        self.spent += cost
        return amount - cost

    def on_leaf_end(self, amount: float) -> None:
        """A branch ended holding ``amount``: what it did not spend (beyond its own leaf) goes to the pool."""
        self.pool += max(amount - (1.0 if self.unit == "leaves" else 0.0), 0.0)


class Plan(abc.ABC):
    """One tree's plan: all the tree sampler asks and tells about the tree's shape.

    The sampler asks :meth:`eligible` of every node a branch reaches, scores the eligible ones when
    :attr:`uses_scores`, and asks :meth:`widths` for their widths (grown in waves when :attr:`waves`); it forks the
    root into :attr:`root_width` and keeps every branch's amount in :attr:`budget` (:class:`TreeBudget`). When the
    tree is done, :meth:`completed` fills in its record and :meth:`metrics` gives the plan's ``bpo/...`` metrics.

    Attributes:
        kind: which plan grew the tree (:attr:`TreeRecord.plan`).
        rollout_n: N, verl's ``actor_rollout_ref.rollout.n``: the flat rollouts the tree stands for.
        root_width: K0, the root fork's children (reserved in :attr:`budget`).
        budget: the tree's budget.
        uses_scores: the plan reads fork scores (the sampler computes them only then).
        waves: the plan ranks a whole wave's candidates, so the tree must grow in waves.
    """

    kind: str
    root_width: int
    budget: TreeBudget
    uses_scores: bool
    waves: bool

    def __init__(self, config: BPOConfig, rollout_n: int) -> None:
        self.config, self.rollout_n = config, rollout_n

    def eligible(self, view: NodeView) -> bool:
        """Whether the node is a fork candidate (:func:`is_eligible`)."""
        return is_eligible(view, self.config)

    @abc.abstractmethod
    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        """Children for each eligible candidate (1 = no fork), its score alongside; a fork's new leaves are reserved
        in :attr:`budget` now. Reads only the candidates' views and scores."""

    def completed(self, record: TreeRecord) -> TreeRecord:
        """``record`` of the finished tree, with what the plan knows of it."""
        return dataclasses.replace(record, plan=self.kind, rollout_n=self.rollout_n, score_free=not self.uses_scores)

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """The plan's ``bpo/...`` metrics of the finished tree."""


class FixedPlan(Plan):
    """The fixed rule: a root fork of K0, then forks of K placed by the selector within exactly N leaves (a
    ``leaves`` budget whose cap is N)."""

    uses_scores = True

    def __init__(self, config: BPOConfig, rollout_n: int, threshold: float) -> None:
        super().__init__(config, rollout_n)
        flat = config.is_flat(rollout_n)
        self.kind = "flat" if flat else "fixed"
        self.waves = config.fixed.selector == "topB_wave" and not flat
        self.root_width = config.root_width(rollout_n)
        self.budget = TreeBudget("leaves", rollout_n, config.leaf_cap(rollout_n))
        self.budget.reserve(self.root_width)
        self.forks_wanted = math.ceil(self.budget.leaves_left / (config.fixed.k - 1))  # forks of K the leaves allow
        self.threshold = threshold  # quantile's τ, fixed for the tree when it starts
        self.scores: list[float] = []  # every candidate's score, for the next tree's τ

    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        """Children for each of a wave's eligible candidates (1 = no fork), within the leaves left.

        Only the candidates' own scores are read, and every width is decided before any child is drawn.
        """
        self.scores.extend(scores)
        k = self.config.fixed.k
        widths = [1] * len(scores)
        if self.config.fixed.selector == "topB_wave":
            order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep arrival order
            cap = self.config.fixed.max_forks_per_wave
        else:
            order = [i for i, s in enumerate(scores) if s >= self.threshold]
            cap = None
        for i in order:
            left = self.budget.leaves_left
            if left <= 0 or (cap is not None and sum(w > 1 for w in widths) >= cap):
                break
            widths[i] = min(k, left + 1)
            self.budget.reserve(widths[i])
        return widths

    def completed(self, record: TreeRecord) -> TreeRecord:
        return dataclasses.replace(super().completed(record), fork_scores=tuple(self.scores),
                                   forks_wanted=self.forks_wanted)

    def metrics(self) -> dict[str, float]:
        if not self.scores:
            return {}
        return {"bpo/score_mean": sum(self.scores) / len(self.scores), "bpo/score_max": max(self.scores)}


class _LearnedPlan(Plan):
    """What the learned plans share: a budget in ``bpo.learned.budget_unit`` whose root amount is given, or N flat
    rollouts' worth under the profile; the leaf cap of ``bpo.learned.max_leaves``; and the tree's randomness."""

    uses_scores = False
    waves = False

    def __init__(self, config: BPOConfig, rollout_n: int, profile: DepthProfile, rng: random.Random,
                 root_budget: float | None = None, budget_source: str = "given") -> None:
        super().__init__(config, rollout_n)
        unit = str(config.learned.budget_unit)
        if root_budget is None:
            root_budget = rollout_n * (1.0 if unit == "leaves" else profile.episode_cost(unit))
            budget_source = "sandbox"
        self.budget = TreeBudget(unit, root_budget, config.leaf_cap(rollout_n))
        self.budget_source = budget_source  # given, task (its own episode cost) or sandbox (the sandbox average)
        self.rng = rng

    def stochastic_round(self, x: float) -> int:
        base = math.floor(x)
        return base + (self.rng.random() < x - base)

    def metrics(self) -> dict[str, float]:
        out = {"bpo/budget": self.budget.root_budget, "bpo/explore_tree": float(self.kind == "explore"),
               "bpo/budget_from_task": float(self.budget_source == "task")}
        if self.budget.unit != "leaves":
            out["bpo/budget_spent"] = self.budget.spent
        return out


class AllocationPlan(_LearnedPlan):
    """The learned allocation (``bpo.allocation=learned``): the shape of least leave-one-out gradient variance
    within the budget, under the profile's model (:mod:`verl_bpo.core.shape`), applied node by node.

    At the tree's start the search picks per-depth widths K_d among the candidate shapes whose cost fits the root
    budget B (the flat shape K_0 = N, RLOO, is one: the tree becomes it when the first turn decides everything or
    nothing is known). A node at a depth d where the shape forks (K_d > 1), holding amount b, then gets
    K = stochastic_round(K_d · b / P_d) children, clamped to [1, b / C_d] (the root at least 2): P_d is what the
    shape plans to spend below such a node and C_d the expected cost of one path from d to its end, so a subtree
    that was handed more than planned (by paths that ended early) widens, one handed less narrows, and the budget
    is kept. Under a turn or token budget a node also forks no wider than its share of the leaf cap:
    ``floor(cap · ω / L_d)``, ω its mass and L_d the leaves the shape plans below each child. Without it, nodes that
    forked first, rounded up, could spend the cap, and the last ones at their depth got only what remained, so their
    leaves could weigh several times their cousins' (a ``real_late`` tree: three root paths forked into 10, the last
    into 2, masses 0.025 and 0.125: 5×), which raises the tree's variance by its factor L · Σ ω² and follows which
    branch came first. A share holds the shares below it, so the cap cannot run out before any node's turn and no
    width depends on the leaves other nodes took (a node's amount still may: the pool). Where the cap binds, what a
    node holds beyond its share stays unspent (on ``real_late``'s warm start 342 generated tokens per batch with
    shares, 357 without). Under a leaf budget the amounts are leaves and already deal out the cap.

    A node at a depth where the shape makes no fork never forks: what it holds beyond the plan goes down to
    the next depth that does, since a fork elsewhere buys what the model prices lower, and on a routine walk it
    leaves sibling turns' coefficients uncancelled (docs/results.md, "Where the noise sits").

    The model measures a turn's gradient size by 1 − p(token), blind to how large each token's parameter gradient
    is, and assumes that size independent of the return; on a real policy the allocation can lose
    (docs/results.md, "The model against the measurement"). ``bpo/predicted_variance_ratio`` logs what the model
    expects against RLOO.
    """

    kind = "learned"

    def __init__(self, config: BPOConfig, rollout_n: int, profile: DepthProfile, rng: random.Random,
                 root_budget: float | None = None, budget_source: str = "given") -> None:
        super().__init__(config, rollout_n, profile, rng, root_budget, budget_source)
        T, unit, budget = config.max_turns, self.budget.unit, self.budget.root_budget
        survival = profile.survival
        per_sample = profile.per_sample_cost(unit)
        # The shapes searched (kept for diagnostics that price them under another model)
        self.candidates = candidate_widths(T, self.budget.leaf_cap, max(config.min_depth, 1), config.cooldown,
                                           min(config.max_forks_per_path or MAX_SEARCH_FORKS, MAX_SEARCH_FORKS))
        self.shape = best_shape(self.candidates, profile.credited_variance(), profile.gradient_mass(), per_sample,
                                budget, rollout_n)
        samples = np.cumprod(self.shape.widths.astype(float))
        before = np.concatenate([[1.0], samples[:-1]])  # n_{d−1}
        below = np.cumsum((per_sample * samples)[::-1])[::-1]  # Σ_{j≥d} q_j n_j
        self.planned = np.where(survival > 0, below / np.maximum(survival * before, 1e-12), 0.0)  # P_d
        self.cost_left = np.array([profile.cost_left(d, unit) for d in range(T)])
        self.leaves_below = np.concatenate([np.cumprod(self.shape.widths[:0:-1])[::-1], [1]])  # L_d = Π_{j>d} K_j
        self.root_width = min(self.budget.leaf_cap, max(2, self._width(0, budget, 1.0)))
        self.budget.reserve(self.root_width)

    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        widths = []
        for view in views:
            left = self.budget.leaves_left
            widths.append(min(self._width(view.depth, view.budget, view.mass), left + 1) if left > 0 else 1)
            self.budget.reserve(widths[-1])
        return widths

    def _width(self, depth: int, amount: float, mass: float) -> int:
        if depth >= len(self.planned) or self.shape.widths[depth] <= 1:
            return 1  # off the shape's fork depths a surplus flows down to the next one (class docstring)
        planned = self.planned[depth]
        x = self.shape.widths[depth] * amount / planned if planned > 0 else 1.0
        high = amount if self.budget.unit == "leaves" else amount / self.cost_left[depth]
        width = self.stochastic_round(min(max(x, 1.0), max(high, 1.0)))
        if self.budget.unit != "leaves":  # a leaf budget's amounts are leaves: they already deal out the cap
            width = min(width, math.floor(self.budget.leaf_cap * mass / self.leaves_below[depth] + 1e-9))
        return max(1, width)

    def metrics(self) -> dict[str, float]:
        ratio = self.shape.variance / self.shape.flat_variance if self.shape.flat_variance > 0 else 1.0
        return {**super().metrics(), "bpo/predicted_variance_ratio": ratio}


class ExplorePlan(_LearnedPlan):
    """The exploration shape: R root paths, each forking once into 2 at one depth drawn for the tree uniformly from
    [1, H − 1], independent of any score. H is the expected episode length the profile has learned (``max_turns``
    before any tree), so forks land where episodes go. Every root path forks at the tree's one depth, not each at
    its own: identical routine turns of root siblings then share one leave-one-out baseline whose coefficients
    cancel, as RLOO's do; forks at scattered depths end the siblings' segments at different depths and leave those
    turns' coefficients uncancelled (docs/results.md, "Where the noise sits").

    R fills the budget on average: R = stochastic_round(B / (c + s̄)), c the expected cost of an episode and s̄ that
    of the suffix a fork at a uniformly drawn depth adds (both from the profile), at least 2 and at most the leaf
    cap. Under a leaf budget, and before the profile has seen a tree, R = max(2, N/2) (N leaves at most). R reads
    the budget and the profile only, never a node, so the shape stays score-free."""

    kind = "explore"

    def __init__(self, config: BPOConfig, rollout_n: int, profile: DepthProfile, rng: random.Random,
                 root_budget: float | None = None, budget_source: str = "given") -> None:
        super().__init__(config, rollout_n, profile, rng, root_budget, budget_source)
        unit = self.budget.unit
        self.horizon = min(config.max_turns, max(2, round(profile.episode_cost("turns"))))
        if unit == "leaves" or not profile.trees:
            root = max(2, rollout_n // 2)
        else:
            survival = profile.survival
            suffix = np.mean([survival[d] * profile.cost_left(d, unit) for d in range(1, self.horizon)])
            root = self.stochastic_round(self.budget.root_budget / (profile.episode_cost(unit) + suffix))
        self.root_width = min(self.budget.leaf_cap, max(2, root))
        self.budget.reserve(self.root_width)
        # forks of 2 left: one per root path, and under a leaf budget no more than the N leaves allow
        self.forks_left = (rollout_n - self.root_width) if unit == "leaves" else self.root_width
        self.fork_depth = self.rng.randint(1, max(self.horizon - 1, 1))

    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        widths = []
        for view in views:
            # a path reaches the tree's one fork depth once, so it forks at most once
            fork = view.depth == self.fork_depth and self.forks_left > 0 and self.budget.leaves_left > 0
            widths.append(2 if fork else 1)
            self.forks_left -= fork
            self.budget.reserve(widths[-1])
        return widths


class ForkPolicy:
    """Decides the shape of every tree of a run, and learns across them (module docstring).

    Persistent state (the ``quantile`` threshold, the depth profile, the tasks' episode costs, the trees counted
    against the warm-up) changes in :meth:`learn` only, from a finished tree's record; a tree reads it once, when
    :meth:`start_tree` makes its plan. :meth:`state_dict` / :meth:`load_state_dict` move it between processes and
    into checkpoints.
    """

    STATE_VERSION = 1

    def __init__(self, config: BPOConfig) -> None:
        if config.mode == "auto":
            raise ValueError("resolve bpo.mode=auto with BPOConfig.for_estimator() before building a ForkPolicy")
        self.config = config
        self.threshold: dict[int, float] = {}  # quantile τ per N, from the last finished tree
        learned = config.learned
        self.profile = DepthProfile(config.max_turns, learned.profile_prior, learned.profile_window,
                                    learned.cost_window)
        # per task: one episode's cost under the policy of the task's last tree, and the sandbox average then
        self.task_costs: dict[str, dict[str, float]] = {}
        # Trees that could fork (learned plans; flat validation groups never count). The warm-up counts those
        # started, and a policy that only learns (the trainer's) counts those it learned from as started.
        self.trees_started = 0
        self.trees_learned = 0

    @property
    def learned(self) -> bool:
        return self.config.mode == "tree" and self.config.allocation == "learned"

    def start_tree(self, rollout_n: int, seed: int = 0, root_budget: float | None = None,
                   task_key: str | None = None) -> Plan:
        """The plan of a tree for N = ``rollout_n``; ``seed`` drives its random choices (exploration, rounding).

        ``root_budget`` (learned plans): what the tree may spend, in ``bpo.learned.budget_unit``, e.g. the tokens a
        baseline's group spent on the same task, for a comparison at matched compute. It must not depend on this
        tree's own samples. ``None``: what N flat rollouts of this task would cost: N times one episode of the
        task as its last tree measured it (``task_key`` names the task), scaled by how the sandbox's average
        episode changed since; for a task not seen before, N times the sandbox's average episode over recent
        trees."""
        if not self.learned or self.config.is_flat(rollout_n):
            return FixedPlan(self.config, rollout_n, self.threshold.get(rollout_n, -math.inf))
        rng = random.Random(seed)
        self.trees_started += 1
        learned = self.config.learned
        explore = self.trees_started <= learned.warmup_trees or rng.random() < learned.explore_share
        cls = ExplorePlan if explore else AllocationPlan
        source = "given"
        if root_budget is None and (root_budget := self.task_budget(rollout_n, task_key)) is not None:
            source = "task"
        return cls(self.config, rollout_n, self.profile, rng, root_budget, source)

    def task_budget(self, rollout_n: int, task_key: str | None) -> float | None:
        """N flat rollouts of a task seen before, in ``bpo.learned.budget_unit``; ``None`` for a task not seen yet
        (and under a leaf budget, which is N leaves whatever the task)."""
        unit = str(self.config.learned.budget_unit)
        cost = self.task_costs.get(task_key) if task_key is not None and unit != "leaves" else None
        if cost is None or cost[unit] <= 0 or cost[f"sandbox_{unit}"] <= 0:
            return None
        return rollout_n * cost[unit] * self.profile.episode_cost(unit) / cost[f"sandbox_{unit}"]

    def finish_tree(self, plan: Plan, record: TreeRecord | None = None, learn: bool = True) -> TreeRecord:
        """``record`` of a tree grown by ``plan``, completed with what the plan knows; the policy learns from it
        (unless ``learn`` is false: the caller teaches it later) and returns it (the record a worker hands the
        run's one policy)."""
        record = plan.completed(record if record is not None else TreeRecord((), (), (), {}, {}))
        if learn:
            self.learn(record)
        return record

    def learn(self, record: TreeRecord) -> None:
        """Learn from a finished tree: the quantile threshold (fixed rule), or the depth profile and the task's
        episode cost (learned plans). Flat groups teach nothing."""
        if record.plan == "fixed":
            if self.config.fixed.selector == "quantile" and record.fork_scores:
                rate = min(1.0, record.forks_wanted / len(record.fork_scores))
                self.threshold[record.rollout_n] = (-math.inf if rate >= 1.0 else
                                                    float(np.quantile(np.asarray(record.fork_scores), 1.0 - rate)))
            return
        if record.plan not in ("explore", "learned"):
            return
        self.trees_learned += 1
        self.trees_started = max(self.trees_started, self.trees_learned)
        self.profile.update(record)
        if record.task_key is not None:
            self.task_costs[record.task_key] = {
                f"{prefix}{unit}": (record.episode_cost(unit) if not prefix else self.profile.episode_cost(unit))
                for unit in ("turns", "tokens") for prefix in ("", "sandbox_")}

    def state_dict(self, task_keys: Collection[str] | None = None) -> dict:
        """Everything learned, as plain JSON-able values; ``task_keys`` limits the task costs to those tasks (the
        state a step's workers need)."""
        costs = self.task_costs if task_keys is None else {k: self.task_costs[k] for k in task_keys
                                                           if k in self.task_costs}
        return {"version": self.STATE_VERSION, "trees_started": self.trees_started,
                "trees_learned": self.trees_learned, "threshold": {str(n): t for n, t in self.threshold.items()},
                "profile": self.profile.state_dict(), "task_costs": costs}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`."""
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(f"BPO allocation state version {state.get('version')!r} is not "
                             f"{self.STATE_VERSION}; it was written by another verl-bpo version")
        self.trees_started, self.trees_learned = int(state["trees_started"]), int(state["trees_learned"])
        self.threshold = {int(n): float(t) for n, t in state["threshold"].items()}
        self.profile.load_state_dict(state["profile"])
        self.task_costs = {k: dict(v) for k, v in state["task_costs"].items()}

    def metrics(self) -> dict[str, float]:
        """The learned state, logged once per step by the trainer."""
        if not self.learned:
            return {}
        return {**self.profile.metrics(), "bpo/profile/trees_learned": float(self.trees_learned),
                "bpo/profile/tasks_costed": float(len(self.task_costs))}
