"""Reference BPO on a small stochastic tabular MDP: grow trees, estimate the policy gradient, compare to the truth.

Readable top to bottom (CleanRL style), used by the unbiasedness tests (T2/T3) and ``benchmarks/variance.py``.

    1. ``TabularMDP``: horizon T, states (t, x) with x one of a few outcomes, A actions, stochastic transitions
       P(x' | t, x, a), a per-turn reward and a Bernoulli success reward on the last turn.
    2. A softmax policy with logits θ[t, x, a].
    3. ``exact_gradient``: ∇J by enumerating every path (a₀ x₁ a₁ x₂ …).
    4. ``grow_tree``: the online, non-anticipating tree of spec §3.4 — waves of turns; before each wave the pending
       nodes are scored from their own history only and the selector forks some of them; every path then samples
       a fresh turn. ``posthoc=True`` is the biased ARPO/TreeRL ablation (fork after seeing the kept turn).
    5. ``estimate_gradients``: BPO credit (``verl_bpo.tree.compute_credit``) for a batch of trees, then
       ĝ = Σ_nodes ω · A · ∇log π for each tree.

Flat mode (K0 = N, no forks) gives RLOO; ``CreditOptions(baseline="mean_incl_self", scale="group_std")`` gives GRPO.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import random
from collections.abc import Callable
from typing import Literal

import numpy as np

from verl_bpo.branching import BranchingConfig, ForkBudget, NodeView, is_eligible, make_selector
from verl_bpo.tree import CreditOptions, Forest, compute_credit

__all__ = [
    "TabularMDP",
    "softmax_policy",
    "exact_gradient",
    "state_values",
    "TreeSample",
    "grow_tree",
    "forest_of",
    "estimate_gradients",
    "late_variance_mdp",
    "early_variance_mdp",
    "random_mdp",
]


# ---------------------------------------------------------------------------------------------------------------
# 1. The MDP and the policy


@dataclasses.dataclass(frozen=True)
class TabularMDP:
    """A finite-horizon MDP over states (t, x), t < horizon, x < n_outcomes; the start state is (0, 0).

    Attributes:
        transition: ``(T, X, A, X)`` P(x' | t, x, a).
        reward: ``(T, X, A, X)`` deterministic reward of the turn (t, x, a) → x'.
        success: ``(X, A, X)`` probability of an extra reward 1 on the last turn (x, a) → x'.
        gamma: discount per turn.
    """

    transition: np.ndarray
    reward: np.ndarray
    success: np.ndarray
    gamma: float = 1.0

    @property
    def horizon(self) -> int:
        return self.transition.shape[0]

    @property
    def n_outcomes(self) -> int:
        return self.transition.shape[1]

    @property
    def n_actions(self) -> int:
        return self.transition.shape[2]

    @functools.cached_property
    def _tables(self) -> tuple[list, list, list]:
        # Plain nested lists: sampling one turn from Python lists is ~50x faster than rng.choice on arrays.
        cdf = np.cumsum(self.transition, axis=-1)
        cdf[..., -1] = 1.0
        return cdf.tolist(), self.reward.tolist(), self.success.tolist()

    def step(self, t: int, x: int, a: int, rng: random.Random) -> tuple[int, float]:
        """Sample x' and the turn's reward."""
        cdf, reward, success = self._tables
        x_next = bisect.bisect_right(cdf[t][x][a], rng.random())
        r = reward[t][x][a][x_next]
        if t == self.horizon - 1:
            r += float(rng.random() < success[x][a][x_next])
        return x_next, r


def softmax_policy(theta: np.ndarray) -> np.ndarray:
    """π[t, x, a] from logits θ[t, x, a]."""
    z = np.exp(theta - theta.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------------------------
# 2. The exact gradient by path enumeration


def exact_gradient(mdp: TabularMDP, theta: np.ndarray) -> tuple[float, np.ndarray]:
    """J(θ) and ∇J(θ) = E[Σ_t γ^t ∇log π(a_t|s_t) G_t], summed over every path (a₀, x₁, …, a_{T−1}, x_T)."""
    pi = softmax_policy(theta)
    T, X, A = mdp.horizon, mdp.n_outcomes, mdp.n_actions
    J, grad = 0.0, np.zeros_like(theta)
    for path in itertools.product(range(A), range(X), repeat=T):
        actions, outcomes = path[0::2], path[1::2]
        prob, x, states, rewards = 1.0, 0, [], []
        for t, (a, x_next) in enumerate(zip(actions, outcomes)):
            prob *= pi[t, x, a] * mdp.transition[t, x, a, x_next]
            states.append(x)
            r = mdp.reward[t, x, a, x_next]
            if t == T - 1:
                r += mdp.success[x, a, x_next]  # expected success reward
            rewards.append(r)
            x = x_next
        if prob == 0.0:
            continue
        discounts = mdp.gamma ** np.arange(T)
        J += prob * float(discounts @ rewards)
        for t, (a, x) in enumerate(zip(actions, states)):
            go = float(discounts[: T - t] @ rewards[t:])  # G_t
            score = -pi[t, x].copy()
            score[a] += 1.0  # ∇_θ[t,x,:] log π(a | t, x)
            grad[t, x] += prob * discounts[t] * go * score
    return J, grad


def state_values(mdp: TabularMDP, theta: np.ndarray) -> np.ndarray:
    """V(t, x) under π_θ by backward induction, ``(T + 1, X)`` with V(T, ·) = 0."""
    pi = softmax_policy(theta)
    T, X = mdp.horizon, mdp.n_outcomes
    value = np.zeros((T + 1, X))
    for t in reversed(range(T)):
        r = mdp.reward[t] + (mdp.success if t == T - 1 else 0.0)  # (X, A, X') expected turn reward
        q = (mdp.transition[t] * (r + mdp.gamma * value[t + 1][None, None, :])).sum(axis=-1)
        value[t] = (pi[t] * q).sum(axis=-1)
    return value


# ---------------------------------------------------------------------------------------------------------------
# 3. Growing one tree (spec §3.4)


@dataclasses.dataclass
class TreeSample:
    """One tree: nodes in creation order (parent before child) and, per non-root node, the turn that made it.

    Attributes:
        parent, reward: the :class:`~verl_bpo.tree.Forest` arrays of this tree.
        state_t, state_x, action: the state the turn was taken in and its action (−1 at the root).
        drawn_at: per node, the index of the policy draw that sampled its turn (−1 at the root).
        decided_at: per node, the number of policy draws made when its fork decision was taken (−1: never
            decided). Non-anticipation (test T8): every child was drawn after its parent's decision,
            ``drawn_at[c] >= decided_at[parent[c]]``.
    """

    parent: list[int]
    reward: list[float]
    state_t: list[int]
    state_x: list[int]
    action: list[int]
    drawn_at: list[int]
    decided_at: list[int]

    @property
    def turns(self) -> int:
        return len(self.parent) - 1

    def respects_non_anticipation(self) -> bool:
        return all(self.drawn_at[c] >= self.decided_at[self.parent[c]] >= 0 for c in range(1, len(self.parent)))


Score = Literal["entropy", "parent_surprisal", "kept_surprisal"]


@dataclasses.dataclass
class _Path:
    node: int
    t: int
    x: int
    forks: int = 0
    since_fork: int = 0
    pending: tuple[int, int] | None = None  # posthoc only: (action, draw index) sampled before the decision


def grow_tree(
    mdp: TabularMDP,
    theta: np.ndarray,
    branching: BranchingConfig,
    selector,
    rng: np.random.Generator,
    score: Score = "entropy",
    score_noise: float = 0.0,
    k_choices: tuple[int, ...] | None = None,
    on_decide: Callable[[NodeView], None] | None = None,
) -> TreeSample:
    """Grow one tree of ``branching.n_leaves`` leaves with the online fork rule.

    ``score``: ``"entropy"`` (S1: entropy of π at the node, plus Gaussian ``score_noise``), ``"parent_surprisal"``
    (S3: −log π of the turn into the node), or ``"kept_surprisal"`` (S4, posthoc and biased: the node's own kept
    turn is drawn first and its surprisal decides the fork). ``k_choices``: draw each fork's K uniformly from
    these (unbalanced trees); default ``branching.k``. ``selector``: from :func:`~verl_bpo.branching.make_selector`.
    """
    pi = softmax_policy(theta)
    log_pi = np.log(pi).tolist()
    entropy = (-(pi * np.log(pi)).sum(axis=-1)).tolist()
    pi_cdf = np.cumsum(pi, axis=-1)
    pi_cdf[..., -1] = 1.0
    pi_cdf = pi_cdf.tolist()
    py_rng = random.Random(int(rng.integers(2**63)))
    posthoc = score == "kept_surprisal"
    tree = TreeSample([-1], [0.0], [0], [0], [-1], [-1], [0])
    budget = ForkBudget(branching)
    forks_wanted = budget.forks_wanted
    draws = 0
    all_scores: list[float] = []

    def draw(t: int, x: int) -> tuple[int, int]:
        nonlocal draws
        draws += 1
        return bisect.bisect_right(pi_cdf[t][x], py_rng.random()), draws - 1

    def add_child(path: _Path, action: tuple[int, int]) -> None:
        a, drawn_at = action
        x_next, r = mdp.step(path.t, path.x, a, py_rng)
        tree.parent.append(path.node)
        tree.reward.append(r)
        tree.state_t.append(path.t)
        tree.state_x.append(path.x)
        tree.action.append(a)
        tree.drawn_at.append(drawn_at)
        tree.decided_at.append(-1)
        path.node, path.t, path.x, path.since_fork = len(tree.parent) - 1, path.t + 1, x_next, path.since_fork + 1

    paths = [_Path(0, 0, 0) for _ in range(branching.root_k)]  # the root is always a fork of K0
    while active := [p for p in paths if p.t < mdp.horizon]:
        if posthoc:
            for p in active:
                p.pending = draw(p.t, p.x)

        # (1) decide: every path stands on a fresh node; score it from that node's own view only
        candidates, scores = [], []
        for p in active:
            if p.node == 0:
                continue  # the root fork was decided up front
            view = NodeView(
                node_id=p.node, depth=p.t, history=(p.t, p.x),
                parent_turn_surprisal=-log_pi[tree.state_t[p.node]][tree.state_x[p.node]][tree.action[p.node]],
                forks_on_path=p.forks, turns_since_fork=p.since_fork, horizon_left=mdp.horizon - p.t,
            )
            if on_decide is not None:
                on_decide(view)
            tree.decided_at[p.node] = draws
            if not is_eligible(view, branching):
                continue
            if score == "entropy":
                s = entropy[p.t][p.x] + score_noise * py_rng.gauss(0.0, 1.0)
            elif score == "parent_surprisal":
                s = view.parent_turn_surprisal
            else:
                s = -log_pi[p.t][p.x][p.pending[0]]
            candidates.append(p)
            scores.append(s)
        all_scores.extend(scores)
        for i in selector.select(list(range(len(candidates))), scores, budget):
            p = candidates[i]
            children = budget.children_for_fork(py_rng.choice(k_choices) if k_choices else None)
            if children < 2:
                continue
            budget.spend(children)
            paths.extend(_Path(p.node, p.t, p.x, p.forks + 1, 0) for _ in range(children - 1))
            p.forks, p.since_fork = p.forks + 1, 0

        # (2) act: every path samples a fresh turn (a posthoc path keeps the turn it drew before deciding)
        for p in [q for q in paths if q.t < mdp.horizon]:
            action = p.pending if p.pending is not None else draw(p.t, p.x)
            p.pending = None
            add_child(p, action)
    selector.end_tree(all_scores, forks_wanted)
    return tree


# ---------------------------------------------------------------------------------------------------------------
# 4. The BPO gradient estimate of a batch of trees


def forest_of(trees: list[TreeSample]) -> Forest:
    """All trees as one :class:`~verl_bpo.tree.Forest` (node indices offset tree by tree)."""
    sizes = np.array([len(t.parent) for t in trees])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parent = np.concatenate([np.where(np.array(t.parent) >= 0, np.array(t.parent) + o, -1)
                             for t, o in zip(trees, offsets)])
    return Forest(parent, np.concatenate([t.reward for t in trees]))


def estimate_gradients(
    mdp: TabularMDP,
    theta: np.ndarray,
    trees: list[TreeSample],
    options: CreditOptions = CreditOptions(),
    leaf_weights: Literal["mass", "uniform"] = "mass",
) -> np.ndarray:
    """ĝ of each tree, ``(n_trees, T, X, A)``: Σ over turns of W_e · A_e · ∇log π(a|s) (spec §3.5).

    ``leaf_weights="uniform"`` is a negative control: every leaf counts 1/N instead of Π 1/K, so an edge weighs
    (leaves below it)/N — biased on unbalanced trees.
    """
    forest = forest_of(trees)
    credit = compute_credit(forest, dataclasses.replace(options, gamma=mdp.gamma))
    if leaf_weights == "mass":
        weight = credit.mass
    else:
        below = forest.is_leaf.astype(np.float64)
        for level in reversed(forest.levels()[1:]):
            np.add.at(below, forest.parent[level], below[level])
        weight = below / credit.leaves_per_tree

    tree_of = np.repeat(np.arange(len(trees)), [len(t.parent) for t in trees])
    t = np.concatenate([t.state_t for t in trees])
    x = np.concatenate([t.state_x for t in trees])
    a = np.concatenate([t.action for t in trees])
    turn = ~forest.is_root
    pi = softmax_policy(theta)
    score = -pi[t[turn], x[turn]]
    score[np.arange(score.shape[0]), a[turn]] += 1.0
    grads = np.zeros((len(trees),) + theta.shape)
    np.add.at(grads, (tree_of[turn], t[turn], x[turn]), (weight * credit.advantage)[turn][:, None] * score)
    return grads


# ---------------------------------------------------------------------------------------------------------------
# 5. Problems used by the tests and the variance benchmark


def _mdp(horizon: int, n_outcomes: int, n_actions: int, rng: np.random.Generator, gamma: float) -> TabularMDP:
    transition = rng.dirichlet(np.ones(n_outcomes), size=(horizon, n_outcomes, n_actions))
    reward = 0.1 * rng.standard_normal((horizon, n_outcomes, n_actions, n_outcomes))
    success = rng.uniform(0.1, 0.9, size=(n_outcomes, n_actions, n_outcomes))
    return TabularMDP(transition, reward, success, gamma)


def random_mdp(seed: int, gamma: float = 1.0, horizon: int = 3, n_actions: int = 3, n_outcomes: int = 2
               ) -> tuple[TabularMDP, np.ndarray]:
    """A random MDP (depth 3, 3 actions, 2 outcomes by default) and random logits θ."""
    rng = np.random.default_rng(seed)
    mdp = _mdp(horizon, n_outcomes, n_actions, rng, gamma)
    return mdp, rng.normal(0.0, 1.0, size=(horizon, n_outcomes, n_actions))


def _confident_logits(horizon: int, n_actions: int, confidence: float, uncertain_turn: int) -> np.ndarray:
    """Logits with π(action 0) = ``confidence`` on every turn but ``uncertain_turn``, where π is uniform."""
    theta = np.zeros((horizon, 2, n_actions))
    theta[:, :, 0] = np.log(confidence / (1.0 - confidence) * (n_actions - 1))
    theta[uncertain_turn] = 0.0
    return theta


def late_variance_mdp(horizon: int = 8, n_actions: int = 3, confidence: float = 0.97) -> tuple[TabularMDP, np.ndarray]:
    """Most return variance comes from the last decision (typical of long-horizon agents).

    Early turns move between two outcomes at random and pay nothing; on the last turn action 0 succeeds with
    probability 0.9, action 1 with 0.1, the others with 0.5. The policy is confident (π = ``confidence`` on
    action 0) before the last turn and uniform on it, so entropy points at the decision that matters.
    """
    X = 2
    transition = np.full((horizon, X, n_actions, X), 1.0 / X)
    reward = np.zeros((horizon, X, n_actions, X))
    success = np.full((X, n_actions, X), 0.5)
    success[:, 0, :], success[:, 1, :] = 0.9, 0.1
    return TabularMDP(transition, reward, success), _confident_logits(horizon, n_actions, confidence, horizon - 1)


def early_variance_mdp(horizon: int = 8, n_actions: int = 3, confidence: float = 0.97) -> tuple[TabularMDP, np.ndarray]:
    """Most return variance comes from the first decision.

    The first action picks the outcome for good (action 0 → outcome 1, any other → outcome 0); later actions
    change nothing; success has probability 0.9 in outcome 1 and 0.1 in outcome 0. The policy is uniform on
    the first turn and confident afterwards.
    """
    X = 2
    transition = np.zeros((horizon, X, n_actions, X))
    transition[0, :, 0, 1] = 1.0
    transition[0, :, 1:, 0] = 1.0
    for x in range(X):
        transition[1:, x, :, x] = 1.0
    reward = np.zeros((horizon, X, n_actions, X))
    success = np.zeros((X, n_actions, X))
    success[:, :, 1], success[:, :, 0] = 0.9, 0.1
    return TabularMDP(transition, reward, success), _confident_logits(horizon, n_actions, confidence, 0)
