"""Where a tree forks and how wide: the non-anticipating fork rule, its limits, the budgets, and the plans.

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
* A *plan*, one per tree, made by :meth:`ForkPolicy.start_tree`, read by the tree sampler:

  - :class:`FixedPlan` (``bpo.allocation=fixed``): a root fork of K0, then forks of K within exactly N leaves,
    placed by a selector on a fork score. ``topB_wave`` ranks a wave's candidates and forks the best within the
    budget and ``max_forks_per_wave``; ``quantile`` forks a candidate whose score reaches τ, the (1 − ρ) quantile of
    the previous finished tree's candidate scores (ρ = forks the budget allows / candidates seen; τ = −∞ at first).
  - :class:`AllocationPlan` (``learned``): every node holds a budget (turns, tokens, or leaves) and takes the width
    of the shape that, under the learned profile, gives the least leave-one-out gradient variance within the
    budget (:mod:`verl_bpo.core.shape`); a task decided by its first move gets the flat shape K0 = N (RLOO, which
    under the model it cannot do worse than).
  - :class:`ExplorePlan` (``learned``, warm-up and ``explore_share``): enough root paths to fill the budget on
    average (N/2 under a leaf budget), each forking once into 2 at a depth drawn uniformly, independent of any
    score; its leaf pairs teach the profile where outcomes split.

Budgets flow down the tree: a fork splits its node's budget among its children, a turn spends its cost, and what a
path leaves unspent when its episode ends is shared among the branches still running (the shape of a subtree may
depend on other subtrees, never on its own children). Limits (AEPO-style, arXiv:2510.14545): ``min_depth``,
``max_forks_per_path``, ``cooldown`` turns after a fork, and at least one turn of horizon left.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Collection, Hashable, Sequence

import numpy as np

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.profile import DepthProfile, TreeRecord
from verl_bpo.core.shape import MAX_SEARCH_FORKS, best_shape, candidate_widths

__all__ = ["NodeView", "is_eligible", "ForkBudget", "FixedPlan", "AllocationPlan", "ExplorePlan", "ForkPolicy"]


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
        budget: what the node's subtree may still spend (``learned`` plans; ``None`` for the fixed rule).
    """

    node_id: int
    depth: int
    history: Hashable
    parent_turn_surprisal: float | None
    forks_on_path: int
    turns_since_fork: int
    horizon_left: int
    budget: float | None = None


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

    def refund(self, leaves: int) -> None:
        self.leaves_left += leaves


class _Plan:
    """What every plan offers the sampler (budgets are ``None`` when a plan keeps none)."""

    kind = "fixed"  # TreeRecord.plan: which plan grew the tree
    unit = "leaves"  # what budgets count: leaves, turns or tokens
    uses_scores = True  # the sampler scores candidates only for plans that read the scores
    waves = False  # the plan ranks a whole wave's candidates, so the tree must grow in waves
    explore = False

    def __init__(self, config: BPOConfig, n_leaves: int) -> None:
        self.config, self.n_leaves = config, n_leaves
        self.scores: list[float] = []
        self.root_width = config.root_width(n_leaves)
        self.root_budget: float | None = None

    def eligible(self, view: NodeView) -> bool:
        return is_eligible(view, self.config)

    def split(self, budget: float | None, branches: int) -> list[float | None]:
        """The budgets of a fork's ``branches`` (the original included)."""
        return [None] * branches

    def spend(self, budget: float | None, cost: float) -> float | None:
        """A branch's budget after a turn of ``cost``."""
        return budget

    def release(self, budget: float | None) -> None:
        """A branch ended holding ``budget``."""

    def share(self, budgets: Sequence[float | None], running: int | None = None) -> list[float | None]:
        """``budgets`` of some of the ``running`` branches (default: all of them), with their share of what ended
        branches left unspent."""
        return list(budgets)

    def fork_made(self, planned: int, made: int) -> None:
        """A fork :meth:`widths` sized ``planned`` (which reserved its leaves then) got ``made`` branches, the
        original included: fewer when snapshots or restores failed, and the leaves not made return to the budget.
        Reserving at the decision keeps branches that decide while another fork is still restoring within it."""

    @property
    def leaves_left(self) -> float:
        return 0.0

    def metrics(self) -> dict[str, float]:
        return {}


class FixedPlan(_Plan):
    """The fixed rule: a root fork of K0, then forks of K placed by the selector within exactly N leaves."""

    def __init__(self, config: BPOConfig, n_leaves: int, threshold: float) -> None:
        super().__init__(config, n_leaves)
        self.kind = "flat" if config.is_flat(n_leaves) else "fixed"
        self.waves = config.selector == "topB_wave" and not config.is_flat(n_leaves)
        self.budget = ForkBudget(n_leaves, self.root_width)
        self.forks_wanted = math.ceil(self.budget.leaves_left / (config.k - 1))  # forks of K the budget allows
        self.threshold = threshold  # quantile's τ, fixed for the tree when it starts

    @property
    def leaves_left(self) -> float:
        return float(self.budget.leaves_left)

    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        """Children for each of a wave's eligible candidates (1 = no fork), within the leaves left.

        Only the candidates' own scores are read, and every width is decided before any child is drawn.
        """
        self.scores.extend(scores)
        k = self.config.k
        widths = [1] * len(scores)
        if self.config.selector == "topB_wave":
            order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep arrival order
            cap = self.config.max_forks_per_wave
        else:
            order = [i for i, s in enumerate(scores) if s >= self.threshold]
            cap = None
        for i in order:
            if self.budget.leaves_left <= 0 or (cap is not None and sum(w > 1 for w in widths) >= cap):
                break
            widths[i] = min(k, self.budget.leaves_left + 1)
            self.budget.spend(widths[i])
        return widths

    def fork_made(self, planned: int, made: int) -> None:
        self.budget.refund(planned - made)


class _BudgetedPlan(_Plan):
    """Budget bookkeeping shared by the learned plans: per-branch budgets, a pool of what ended branches left,
    and the leaf cap (the sessions verl runs for the task)."""

    uses_scores = False

    def __init__(self, config: BPOConfig, n_leaves: int, profile: DepthProfile, rng: random.Random,
                 budget: float | None = None, budget_source: str = "given") -> None:
        super().__init__(config, n_leaves)
        self.unit = config.budget
        self.budget_source = "sandbox" if budget is None else budget_source
        self.rng = rng
        self.cap = config.leaf_cap(n_leaves)
        self.per_rollout = 1.0 if self.unit == "leaves" else profile.episode_cost(self.unit)
        self.root_budget = n_leaves * self.per_rollout if budget is None else float(budget)
        self.pool = 0.0
        self.branches = 0
        self.spent = 0.0

    def split(self, budget: float | None, branches: int) -> list[float | None]:
        if self.unit != "leaves":
            return [budget / branches] * branches
        whole = int(round(budget))
        return [float(whole // branches + (i < whole % branches)) for i in range(branches)]

    def spend(self, budget: float | None, cost: float) -> float | None:
        if self.unit == "leaves":
            return budget
        self.spent += cost
        return budget - cost

    def release(self, budget: float | None) -> None:
        self.pool += max((budget or 0.0) - (1.0 if self.unit == "leaves" else 0.0), 0.0)

    def share(self, budgets: Sequence[float | None], running: int | None = None) -> list[float | None]:
        running = max(running or len(budgets), len(budgets))
        if not budgets or self.pool <= 0:
            return list(budgets)
        if self.unit == "leaves":
            extra = self.split(self.pool, running)[: len(budgets)]
        else:
            extra = [self.pool / running] * len(budgets)
        self.pool -= sum(extra)
        return [b + e for b, e in zip(budgets, extra)]

    def fork_made(self, planned: int, made: int) -> None:
        self.branches -= planned - made

    @property
    def room(self) -> int:
        """Branches the leaf cap still allows."""
        return self.cap - self.branches

    @property
    def leaves_left(self) -> float:
        return self.pool

    def stochastic_round(self, x: float) -> int:
        base = math.floor(x)
        return base + (self.rng.random() < x - base)

    def metrics(self) -> dict[str, float]:
        out = {"bpo/budget": float(self.root_budget or 0.0), "bpo/explore_tree": float(self.explore),
               "bpo/budget_from_task": float(self.budget_source == "task")}
        if self.unit != "leaves":
            out["bpo/budget_spent"] = self.spent
        return out


class AllocationPlan(_BudgetedPlan):
    """The learned allocation (``bpo.allocation=learned``): the shape of least leave-one-out gradient variance
    within the budget, under the profile's model (:mod:`verl_bpo.core.shape`), applied node by node.

    At the tree's start the search picks per-depth widths K_d among the candidate shapes whose cost fits the root
    budget B (the flat shape K_0 = N, RLOO, is one: the tree becomes it when the first turn decides everything or
    nothing is known). A node at depth d holding budget b then gets K = stochastic_round(K_d · b / P_d) children,
    clamped to [1, b / C_d] (the root at least 2): P_d is what the shape plans to spend below such a node and C_d
    the expected cost of one path from d to its end, so a subtree that was handed more than planned (by paths
    that ended early) widens, one handed less narrows, and the budget is kept.

    The model measures a turn's gradient size by 1 − p(token), blind to how large each token's parameter gradient
    is, and assumes that size independent of the return; on a real policy the allocation can lose
    (docs/results.md, "The model against the measurement"). ``bpo/predicted_variance_ratio`` logs what the model
    expects against RLOO.
    """

    kind = "learned"

    def __init__(self, config: BPOConfig, n_leaves: int, profile: DepthProfile, rng: random.Random,
                 budget: float | None = None, budget_source: str = "given") -> None:
        super().__init__(config, n_leaves, profile, rng, budget, budget_source)
        T = config.max_turns
        survival = profile.survival
        per_sample = profile.per_sample_cost(self.unit)
        candidates = candidate_widths(T, self.cap, max(config.min_depth, 1), config.cooldown,
                                      min(config.max_forks_per_path or MAX_SEARCH_FORKS, MAX_SEARCH_FORKS))
        self.shape = best_shape(candidates, profile.credited_variance(), profile.gradient_mass(), per_sample,
                                self.root_budget, n_leaves)
        samples = np.cumprod(self.shape.widths.astype(float))
        before = np.concatenate([[1.0], samples[:-1]])  # n_{d−1}
        below = np.cumsum((per_sample * samples)[::-1])[::-1]  # Σ_{j≥d} q_j n_j
        self.planned = np.where(survival > 0, below / np.maximum(survival * before, 1e-12), 0.0)  # P_d
        self.cost_left = np.array([profile.cost_left(d, self.unit) for d in range(T)])
        self.root_width = min(self.cap, max(2, self._width(0, self.root_budget)))
        self.branches = self.root_width

    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        widths = []
        for view in views:
            widths.append(min(self._width(view.depth, view.budget), self.room + 1) if self.room > 0 else 1)
            self.branches += widths[-1] - 1  # reserved now; fork_made returns what the fork did not make
        return widths

    def _width(self, depth: int, budget: float | None) -> int:
        if budget is None or depth >= len(self.planned):
            return 1
        planned = self.planned[depth]
        x = self.shape.widths[depth] * budget / planned if planned > 0 else 1.0
        high = budget if self.unit == "leaves" else budget / self.cost_left[depth]
        return max(1, self.stochastic_round(min(max(x, 1.0), max(high, 1.0))))

    def metrics(self) -> dict[str, float]:
        ratio = self.shape.variance / self.shape.flat_variance if self.shape.flat_variance > 0 else 1.0
        return {**super().metrics(), "bpo/predicted_variance_ratio": ratio}


class ExplorePlan(_BudgetedPlan):
    """The exploration shape: R root paths, each forking once into 2 at a depth drawn uniformly from [1, H − 1] (a
    fork hazard of 1 / (H − depth) at each depth), independent of any score. H is the expected episode length the
    profile has learned (``max_turns`` before any tree), so forks land where episodes go.

    R fills the budget on average: R = stochastic_round(B / (c + s̄)), c the expected cost of an episode and s̄ that
    of the suffix a fork at a uniformly drawn depth adds (both from the profile), at least 2 and at most the leaf
    cap. Under a leaf budget, and before the profile has seen a tree, R = max(2, N/2) (N leaves at most). R reads
    the budget and the profile only, never a node, so the shape stays score-free."""

    kind = "explore"
    explore = True

    def __init__(self, config: BPOConfig, n_leaves: int, profile: DepthProfile, rng: random.Random,
                 budget: float | None = None, budget_source: str = "given") -> None:
        super().__init__(config, n_leaves, profile, rng, budget, budget_source)
        self.horizon = min(config.max_turns, max(2, round(profile.episode_cost("turns"))))
        if self.unit == "leaves" or not profile.trees:
            root = max(2, n_leaves // 2)
        else:
            survival = profile.survival
            suffix = np.mean([survival[d] * profile.cost_left(d, self.unit) for d in range(1, self.horizon)])
            root = self.stochastic_round(self.root_budget / (profile.episode_cost(self.unit) + suffix))
        self.root_width = min(self.cap, max(2, root))
        self.branches = self.root_width
        self.extra_leaves = (n_leaves - self.root_width) if self.unit == "leaves" else self.root_width

    def widths(self, views: Sequence[NodeView], scores: Sequence[float]) -> list[int]:
        widths = []
        for view in views:
            fork = (view.forks_on_path == 0 and self.extra_leaves > 0 and self.room > 0
                    and self.rng.random() < 1.0 / max(self.horizon - view.depth, 1))
            widths.append(2 if fork else 1)
            self.extra_leaves -= fork
            self.branches += fork
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
        self.threshold: dict[int, float] = {}  # quantile τ per leaf count N, from the last finished tree
        self.profile = DepthProfile(config.max_turns, config.profile_prior, config.profile_window,
                                    config.cost_window)
        # per task: one episode's cost under the policy of the task's last tree, and the sandbox average then
        self.task_costs: dict[str, dict[str, float]] = {}
        # Trees that could fork (learned plans; flat validation groups never count). The warm-up counts those
        # started, and a policy that only learns (the trainer's) counts those it learned from as started.
        self.trees_started = 0
        self.trees_learned = 0

    @property
    def learned(self) -> bool:
        return self.config.mode == "tree" and self.config.allocation == "learned"

    def start_tree(self, n_leaves: int, seed: int = 0, budget: float | None = None,
                   task_key: str | None = None) -> _Plan:
        """The plan of a tree of N = ``n_leaves``; ``seed`` drives its random choices (exploration, rounding).

        ``budget`` (learned plans): the tree's root budget in ``bpo.budget``'s unit, e.g. the tokens a baseline's
        group spent on the same task, for a comparison at matched compute. It must not depend on this tree's own
        samples. ``None``: what N flat rollouts of this task would cost: N times one episode of the task as its
        last tree measured it (``task_key`` names the task), scaled by how the sandbox's average episode changed
        since; for a task not seen before, N times the sandbox's average episode over recent trees."""
        if not self.learned or self.config.is_flat(n_leaves):
            return FixedPlan(self.config, n_leaves, self.threshold.get(n_leaves, -math.inf))
        rng = random.Random(seed)
        self.trees_started += 1
        explore = self.trees_started <= self.config.warmup_trees or rng.random() < self.config.explore_share
        cls = ExplorePlan if explore else AllocationPlan
        source = "given"
        if budget is None and (budget := self.task_budget(n_leaves, task_key)) is not None:
            source = "task"
        return cls(self.config, n_leaves, self.profile, rng, budget, source)

    def task_budget(self, n_leaves: int, task_key: str | None) -> float | None:
        """N flat rollouts of a task seen before, in ``bpo.budget``'s unit; ``None`` for a task not seen yet."""
        unit = self.config.budget
        cost = self.task_costs.get(task_key) if task_key is not None and unit != "leaves" else None
        if cost is None or cost[unit] <= 0 or cost[f"sandbox_{unit}"] <= 0:
            return None
        return n_leaves * cost[unit] * self.profile.episode_cost(unit) / cost[f"sandbox_{unit}"]

    def finish_tree(self, plan: _Plan, record: TreeRecord | None = None) -> TreeRecord:
        """``record`` of a tree grown by ``plan``, completed with what the plan knows; the policy learns from it
        and returns it (the record a worker hands the run's one policy)."""
        record = record if record is not None else TreeRecord((), (), (), {}, {})
        scores = plan.scores if isinstance(plan, FixedPlan) else ()
        wanted = plan.forks_wanted if isinstance(plan, FixedPlan) else 0
        record = dataclasses.replace(record, plan=plan.kind, n_leaves=plan.n_leaves, fork_scores=tuple(scores),
                                     forks_wanted=wanted, score_free=not plan.uses_scores)
        self.learn(record)
        return record

    def learn(self, record: TreeRecord) -> None:
        """Learn from a finished tree: the quantile threshold (fixed rule), or the depth profile and the task's
        episode cost (learned plans). Flat groups teach nothing."""
        if record.plan == "fixed":
            if self.config.selector == "quantile" and record.fork_scores:
                rate = min(1.0, record.forks_wanted / len(record.fork_scores))
                self.threshold[record.n_leaves] = (-math.inf if rate >= 1.0 else
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
