"""Where a task's outcome is decided: a per-depth profile learned from finished trees, the inputs of the
allocation model (:mod:`verl_bpo.core.shape`).

A tree spends its budget well when its forks sit where return variance is *injected*: a fork only averages the
variance injected below it. What a rollout has (leaf returns, tree structure, turn depths, sampled-token
log-probs) gives, per depth j < T:

    S_j   survival: the probability that an episode takes a turn at depth j (mass-weighted over leaves);
    e_j   gradient mass of a depth-j turn: mean over its tokens of 1 − p(token), an unbiased per-sample estimate of
          1 − Σπ², the squared norm of ∇_logits log π (so ē_j = S_j e_j per episode);
    γ_j   the return variogram: ½(G_ℓ − G_ℓ')² over leaf pairs whose paths split at depth j, measured on trees whose
          forks were decided without reading any node's content (the learned plans decide by depth and budget
          only), so the pairs at a split are fresh samples of the state there and the profile never biases itself;
    D_j = S_j γ_j − S_{j+1} γ_{j+1}: the return variance injected by the turn at depth j (γ_T = 0), each
          estimate shrunk by one standard error across trees. S_j γ_j is the expected conditional variance of the
          return given the first j turns, which cannot grow with j (total variance), so it is fitted as a
          non-increasing sequence (pool adjacent violators, each depth weighted by the trees that measured it):
          a depth few trees split at, common when only exploration trees fork there, shares its neighbours'
          evidence, so noise between two such depths does not read as a decision (a flat walk followed by one
          decisive turn put spurious forks on the walk, docs/results.md, "Where the noise sits").

A share σ_j = κ · min(e_j, 1 − e_j) · D_j is credited one depth earlier (κ = ``bpo.learned.profile_prior``): returns
alone cannot tell where the decisive action's expected gradient changes (a task and its twin whose success
ignores the last action give the same returns and log-probs), so κ is a stated prior, not a hidden constant. The
profile is forgotten exponentially so it follows training: the variogram over ``bpo.learned.profile_window`` trees (it needs
many), S_j, e_j and the turn costs c_j over ``bpo.learned.cost_window`` (each tree measures them well, and a budget planned
on stale costs is overspent or left unspent). Pure numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["TreeRecord", "DepthProfile"]


@dataclasses.dataclass(frozen=True)
class TreeRecord:
    """What one finished tree tells the profile (built by the sampler from its leaves).

    Attributes:
        leaf_paths: per leaf, the node ids from the root to the leaf.
        leaf_returns: per leaf, its return.
        leaf_masses: per leaf, w = Π 1/K.
        turn_uncertainty: per node (the turn leading into it), the mean over its tokens of 1 − p(token).
        turn_tokens: per node, the tokens its turn generated.
        score_free: the tree's forks were decided without reading any node's content (its pairs teach the
            variogram).
        plan: which plan grew it (``fixed``, ``explore`` or ``learned``; ``flat`` for N independent rollouts).
        rollout_n: N, verl's ``actor_rollout_ref.rollout.n``: the flat rollouts the tree stood for.
        fork_scores: the fork scores its candidates got (the fixed rule's ``quantile`` threshold learns them).
        forks_wanted: forks of K its N leaves allowed (fixed rule).
        task_key: which task it grew on (:meth:`ForkPolicy.start_tree`'s ``task_key``), ``None`` when not known.

    A record is what the run's one :class:`~verl_bpo.core.fork_policy.ForkPolicy` learns from, wherever the tree
    grew: :meth:`to_dict` / :meth:`from_dict` carry it from an agent-loop worker to the trainer.
    """

    leaf_paths: Sequence[Sequence[int]]
    leaf_returns: Sequence[float]
    leaf_masses: Sequence[float]
    turn_uncertainty: dict[int, float]
    turn_tokens: dict[int, float]
    score_free: bool = False
    plan: str = "fixed"
    rollout_n: int = 0
    fork_scores: Sequence[float] = ()
    forks_wanted: int = 0
    task_key: str | None = None

    def episode_cost(self, unit: str) -> float:
        """What one episode of the task costs under the policy that grew the tree, Σ_ℓ w_ℓ cost(path ℓ): turns or
        generated tokens (an unbiased estimate: the masses undo the tree's over-sampling of forked subtrees)."""
        per_turn = (lambda node: 1.0) if unit != "tokens" else (lambda node: self.turn_tokens.get(node, 1.0))
        return float(sum(w * sum(per_turn(node) for node in path[1:])
                         for path, w in zip(self.leaf_paths, self.leaf_masses)))

    def to_dict(self) -> dict:
        """Plain JSON-able values (node-keyed maps as ``[node, value]`` pairs)."""
        out = dataclasses.asdict(self)
        out["leaf_paths"] = [list(p) for p in self.leaf_paths]
        for key in ("turn_uncertainty", "turn_tokens"):
            out[key] = [[int(k), float(v)] for k, v in getattr(self, key).items()]
        for key in ("leaf_returns", "leaf_masses", "fork_scores"):
            out[key] = [float(v) for v in getattr(self, key)]
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> TreeRecord:
        raw = dict(raw)
        for key in ("turn_uncertainty", "turn_tokens"):
            raw[key] = {int(k): float(v) for k, v in raw[key]}
        raw["leaf_paths"] = [tuple(p) for p in raw["leaf_paths"]]
        return cls(**raw)


class DepthProfile:
    """Per-depth statistics of finished trees, forgotten exponentially; see the module docstring.

    Args:
        horizon: T, the most turns a path may take (``bpo.max_turns``).
        prior: κ (``bpo.learned.profile_prior``).
        window: trees after which a variogram observation's weight has fallen to 1/e (``bpo.learned.profile_window``).
        cost_window: the same for survival, uncertainty and turn costs (``bpo.learned.cost_window``); default ``window``.
    """

    def __init__(self, horizon: int, prior: float, window: int, cost_window: int | None = None) -> None:
        self.horizon, self.prior = horizon, prior
        self.decay = math.exp(-1.0 / max(window, 1))
        self.cost_decay = math.exp(-1.0 / max(cost_window or window, 1))
        T = horizon
        self.trees = 0.0  # decayed count of trees (all, by cost_window) and of those that teach the variogram
        self.variogram_trees = 0.0
        self._alive = np.zeros(T)  # Σ over trees of Σ_ℓ w_ℓ 1[path takes turn j]
        self._uncertainty = np.zeros(T)  # ... w_ℓ e(turn j)
        self._tokens = np.zeros(T)  # ... w_ℓ tokens(turn j)
        self._gamma = np.zeros(T)  # Σ over score-free trees of their mean ½(G − G')² at split depth j
        self._gamma_sq = np.zeros(T)
        self._gamma_trees = np.zeros(T)

    # --- learning -----------------------------------------------------------------------------------------------
    def update(self, record: TreeRecord) -> None:
        c, d = self.cost_decay, self.decay
        for array in (self._alive, self._uncertainty, self._tokens):
            array *= c
        self.trees = self.trees * c + 1.0
        for path, mass in zip(record.leaf_paths, record.leaf_masses):
            for j, node in enumerate(path[1:self.horizon + 1]):
                self._alive[j] += mass
                self._uncertainty[j] += mass * record.turn_uncertainty.get(node, 0.0)
                self._tokens[j] += mass * record.turn_tokens.get(node, 1.0)
        if record.score_free:
            for array in (self._gamma, self._gamma_sq, self._gamma_trees):
                array *= d
            self.variogram_trees = self.variogram_trees * d + 1.0
            for j, value in _variogram(record, self.horizon).items():
                self._gamma[j] += value
                self._gamma_sq[j] += value * value
                self._gamma_trees[j] += 1.0

    def state_dict(self) -> dict:
        """Everything learned, as plain JSON-able values (a checkpoint, or the state handed to every worker)."""
        arrays = ("_alive", "_uncertainty", "_tokens", "_gamma", "_gamma_sq", "_gamma_trees")
        return {"trees": self.trees, "variogram_trees": self.variogram_trees,
                **{name.lstrip("_"): getattr(self, name).tolist() for name in arrays}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (of a profile with the same horizon)."""
        self.trees, self.variogram_trees = float(state["trees"]), float(state["variogram_trees"])
        for name in ("alive", "uncertainty", "tokens", "gamma", "gamma_sq", "gamma_trees"):
            values = np.asarray(state[name], dtype=float)
            if values.shape != (self.horizon,):
                raise ValueError(f"a depth profile of horizon {len(values)} cannot be loaded into one of horizon "
                                 f"{self.horizon} (bpo.max_turns changed since it was saved)")
            setattr(self, f"_{name}", values)

    # --- what it says -------------------------------------------------------------------------------------------
    @property
    def survival(self) -> np.ndarray:
        """S_j (S_0 = 1 once any tree is seen)."""
        return self._alive / self.trees if self.trees else np.ones(self.horizon)

    @property
    def uncertainty(self) -> np.ndarray:
        """e_j, the mean uncertainty of a depth-j turn (0.5 where no turn was seen)."""
        return np.where(self._alive > 0, self._uncertainty / np.maximum(self._alive, 1e-12), 0.5)

    def turn_cost(self, unit: str) -> np.ndarray:
        """c_j, the mean cost of a depth-j turn: 1 in ``turns``; its generated tokens in ``tokens`` (1 where no
        turn was seen)."""
        if unit != "tokens":
            return np.ones(self.horizon)
        return np.where(self._alive > 0, self._tokens / np.maximum(self._alive, 1e-12), 1.0)

    def episode_cost(self, unit: str) -> float:
        """What one episode costs on average, Σ_j S_j c_j: turns, or tokens (``horizon`` turns before any tree)."""
        return float((self.survival * self.turn_cost(unit)).sum())

    def cost_left(self, depth: int, unit: str) -> float:
        """Expected cost of a path from depth ``depth`` to its end, given it got there (at least its next turn)."""
        if depth >= self.horizon:
            return 1.0
        s, c = self.survival, self.turn_cost(unit)
        alive = s[depth] if s[depth] > 0 else 1.0
        return max(float((s[depth:] * c[depth:]).sum() / alive), float(c[depth]))

    def variogram(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """γ_j as the trees measured it, before any fit, per depth: its mean over the trees that split there (0
        where none did), the variance of the trees' values about it, and the trees (faded) that measured it."""
        n = self._gamma_trees.copy()  # the caller's to keep: the profile goes on updating its own
        mean = np.where(n > 0, self._gamma / np.maximum(n, 1e-12), 0.0)
        spread = np.where(n > 1, self._gamma_sq / np.maximum(n, 1e-12) - mean ** 2, 0.0)
        return mean, spread, n

    def injected_variance(self) -> np.ndarray:
        """D^R_j = S_j γ_j − S_{j+1} γ_{j+1}, from the non-increasing fit of S_j γ_j (module docstring), each
        difference shrunk by one SE of the two fitted values."""
        mean, spread, n = self.variogram()
        measured = n > 0
        s = self.survival
        fit, se = np.full(self.horizon, np.nan), np.zeros(self.horizon)
        depths = np.flatnonzero(measured)
        if depths.size:
            # weights ∝ trees (not 1/SE²: a depth seen in a few trees that happened to agree has SE 0)
            fit[depths], se[depths] = _non_increasing(s[depths] * mean[depths], n[depths],
                                                      s[depths] ** 2 * np.maximum(spread[depths], 0.0))
        gamma = _fill_forward(fit / np.maximum(s, 1e-12))  # unmeasured depths: γ as before them, scaled by S
        scaled = np.concatenate([s * gamma, [0.0]])
        scaled_se = np.concatenate([se, [0.0]])
        raw = scaled[:-1] - scaled[1:]
        return np.maximum(raw - np.sqrt(scaled_se[:-1] ** 2 + scaled_se[1:] ** 2), 0.0)

    def gradient_mass(self) -> np.ndarray:
        """ē_j = S_j e_j, the gradient mass of the depth-j turn per episode."""
        return self.survival * self.uncertainty

    def credited_variance(self) -> np.ndarray:
        """D_j with the prior's share σ_j moved to depth j − 1 (module docstring): what the allocation averages."""
        injected, e = self.injected_variance(), self.uncertainty
        moved = self.prior * np.minimum(e, 1.0 - e) * injected
        return injected - moved + np.concatenate([moved[1:], [0.0]])

    def per_sample_cost(self, unit: str) -> np.ndarray:
        """q_j, what one sample of the depth-j turn costs per episode: S_j c_j in ``turns`` and ``tokens``; in
        ``leaves`` S_j − S_{j+1}, the paths that end after it (a leaf each)."""
        s = self.survival
        if unit == "leaves":
            return s - np.concatenate([s[1:], [0.0]])
        return s * self.turn_cost(unit)

    def metrics(self) -> dict[str, float]:
        """``bpo/profile/...``: per depth the injected return variance, the gradient mass and the survival, for the
        depths where trees were seen."""
        out = {"bpo/profile/trees": float(self.trees), "bpo/profile/variogram_trees": float(self.variogram_trees)}
        injected, mass, survival = self.injected_variance(), self.gradient_mass(), self.survival
        for j in range(self.horizon):
            if survival[j] <= 0:
                break
            out[f"bpo/profile/injected_variance/d{j}"] = float(injected[j])
            out[f"bpo/profile/gradient_mass/d{j}"] = float(mass[j])
            out[f"bpo/profile/survival/d{j}"] = float(survival[j])
        return out


def _non_increasing(values: np.ndarray, trees: np.ndarray, spread: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weighted least-squares non-increasing fit of per-depth means ``values`` (pool adjacent violators),
    each depth weighted by the ``trees`` that measured it, and per depth the standard error of its pooled block,
    from the per-tree variances ``spread``. A block's SE comes from all the trees it pools, so a depth that a few
    trees measured borrows its neighbours' evidence instead of deciding a fork alone. ``trees`` must be positive."""
    blocks: list[list] = []  # [weighted sum, weight, Σ weight·spread, first index, last index]
    for i, (v, w, var) in enumerate(zip(values, trees, spread)):
        blocks.append([w * v, w, w * var, i, i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1][:3], last[:3])] + [blocks[-1][3], last[4]]
    fit, se = np.empty(len(values)), np.empty(len(values))
    for total, weight, var, first, last in blocks:
        fit[first:last + 1] = total / weight
        se[first:last + 1] = math.sqrt(var) / weight
    return fit, se


def _fill_forward(values: np.ndarray) -> np.ndarray:
    """NaNs (depths without a split) take the last known value: no variance injected where nothing was measured;
    leading NaNs take the first known value (0 when nothing is known)."""
    out = values.copy()
    known = ~np.isnan(out)
    if not known.any():
        return np.zeros_like(out)
    first = int(np.flatnonzero(known)[0])
    out[:first] = out[first]
    for j in range(first + 1, len(out)):
        if np.isnan(out[j]):
            out[j] = out[j - 1]
    return out


def _variogram(record: TreeRecord, horizon: int) -> dict[int, float]:
    """Per split depth j: the mean of ½(G − G')² over leaf pairs whose paths first differ at turn j, each pair
    weighted by its leaves' masses w_ℓ w_ℓ' (a subtree that grew more leaves, e.g. because its episode went on
    longer, counts as much as its fork siblings, not more)."""
    sums: dict[int, float] = {}
    weights: dict[int, float] = {}
    paths, returns, masses = record.leaf_paths, record.leaf_returns, record.leaf_masses
    for a in range(len(paths)):
        for b in range(a + 1, len(paths)):
            pa, pb = paths[a], paths[b]
            j = 0
            while j + 1 < min(len(pa), len(pb)) and pa[j + 1] == pb[j + 1]:
                j += 1
            if j >= horizon:
                continue
            w = masses[a] * masses[b]
            sums[j] = sums.get(j, 0.0) + w * 0.5 * (returns[a] - returns[b]) ** 2
            weights[j] = weights.get(j, 0.0) + w
    return {j: sums[j] / weights[j] for j in sums if weights[j] > 0}
