"""A small stochastic tabular MDP and the exact gradient of its expected return under a softmax policy.

The oracle of the unbiasedness tests and the variance benchmark. States are (t, x): turn t < horizon, outcome x.
From (t, x) action a moves to x' ~ P(· | t, x, a) with reward r(t, x, a, x'); then the episode stops with
probability ``stop[t, x, a]`` (always after the last turn), and on the stopping turn a success reward 1 is drawn
with probability ``success[x, a, x']``. A sandbox may also *fail* a step with probability ``fail_prob``
(independent of everything): that turn earns 0 and the episode ends, as a crashed sandbox ends a leaf.

The policy is π(a | t, x) = softmax(θ[t, x])_a. :func:`exact_gradient` computes J(θ) = E[Σ_t γ^t r_t] and

    ∇J = Σ_t γ^t Σ_x d_t(x) Σ_a π(a|t,x) (e_a − π(·|t,x)) Q_t(x, a)

by dynamic programming (d_t: probability of reaching (t, x) alive; Q_t: expected return-to-go), the policy
gradient theorem (Sutton et al. 2000) for a finite horizon. Everything is numpy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

__all__ = [
    "TabularMDP",
    "softmax_policy",
    "exact_gradient",
    "state_values",
    "random_mdp",
    "late_variance_mdp",
    "early_variance_mdp",
    "rare_actions_fail_mdp",
    "PROBLEMS",
    "problem",
]


@dataclasses.dataclass(frozen=True, eq=False)
class TabularMDP:
    """A finite-horizon MDP over states (t, x), t < horizon, x < n_outcomes; the start state is (0, 0).

    Attributes:
        transition: ``(T, X, A, X)`` P(x' | t, x, a).
        reward: ``(T, X, A, X)`` deterministic reward of the turn (t, x, a) → x'.
        success: ``(X, A, X)`` probability of an extra reward 1 on the turn the episode stops.
        stop: ``(T, X, A)`` probability that the episode stops after the turn (before the last turn); default 0.
        gamma: discount per turn.
    """

    transition: np.ndarray
    reward: np.ndarray
    success: np.ndarray
    stop: np.ndarray | None = None
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
    def stop_after(self) -> np.ndarray:
        """``(T, X, A)`` probability that the episode stops after the turn, the horizon included."""
        stop = np.zeros(self.transition.shape[:3]) if self.stop is None else np.asarray(self.stop, dtype=float)
        stop = stop.copy()
        stop[-1] = 1.0
        return stop

    @functools.cached_property
    def tables(self) -> tuple[list, list, list, list]:
        """Nested lists for sampling one turn fast from Python (cumulative P, reward, success, stop)."""
        cdf = np.cumsum(self.transition, axis=-1)
        cdf[..., -1] = 1.0
        return cdf.tolist(), self.reward.tolist(), self.success.tolist(), self.stop_after.tolist()


def softmax_policy(theta: np.ndarray) -> np.ndarray:
    """π[t, x, a] from logits θ[t, x, a]."""
    z = np.exp(theta - theta.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _action_values(mdp: TabularMDP, theta: np.ndarray, fail_prob: float) -> tuple[np.ndarray, np.ndarray]:
    """Q[t, x, a] and V[t, x] by backward induction (V[T] = 0); a failed step earns 0 and ends the episode."""
    pi = softmax_policy(theta)
    T, X, A = mdp.horizon, mdp.n_outcomes, mdp.n_actions
    q, value = np.zeros((T, X, A)), np.zeros((T + 1, X))
    for t in reversed(range(T)):
        stop = mdp.stop_after[t][..., None]  # (X, A, 1)
        turn = mdp.reward[t] + stop * mdp.success + (1.0 - stop) * mdp.gamma * value[t + 1][None, None, :]
        q[t] = (1.0 - fail_prob) * (mdp.transition[t] * turn).sum(axis=-1)
        value[t] = (pi[t] * q[t]).sum(axis=-1)
    return q, value


def state_values(mdp: TabularMDP, theta: np.ndarray, fail_prob: float = 0.0) -> np.ndarray:
    """V(t, x) under π_θ, ``(T + 1, X)`` with V(T, ·) = 0."""
    return _action_values(mdp, theta, fail_prob)[1]


def exact_gradient(mdp: TabularMDP, theta: np.ndarray, fail_prob: float = 0.0) -> tuple[float, np.ndarray]:
    """J(θ) and ∇J(θ) (module docstring), with steps failing independently with probability ``fail_prob``."""
    pi = softmax_policy(theta)
    q, value = _action_values(mdp, theta, fail_prob)
    T, X = mdp.horizon, mdp.n_outcomes
    reach = np.zeros((T, X))  # d_t(x): the episode is alive in state (t, x)
    reach[0, 0] = 1.0
    for t in range(T - 1):
        flow = reach[t][:, None, None] * pi[t][:, :, None] * (1.0 - fail_prob) * mdp.transition[t]
        reach[t + 1] = (flow * (1.0 - mdp.stop_after[t])[..., None]).sum(axis=(0, 1))
    discount = mdp.gamma ** np.arange(T)
    grad = discount[:, None, None] * reach[..., None] * pi * (q - value[:T, :, None])
    return float(value[0, 0]), grad


# ---------------------------------------------------------------------------------------------------------------
# Problems (each returns the MDP and the logits θ at which it is evaluated)


def random_mdp(seed: int, gamma: float = 1.0, horizon: int = 3, n_actions: int = 3, n_outcomes: int = 2,
               stop_prob: float = 0.0) -> tuple[TabularMDP, np.ndarray]:
    """A random MDP (depth 3, 3 actions, 2 outcomes by default) and random logits θ. ``stop_prob`` is the mean
    probability of stopping early after a turn (random per state and action), so episodes end at random depths."""
    rng = np.random.default_rng(seed)
    transition = rng.dirichlet(np.ones(n_outcomes), size=(horizon, n_outcomes, n_actions))
    reward = 0.1 * rng.standard_normal((horizon, n_outcomes, n_actions, n_outcomes))
    success = rng.uniform(0.1, 0.9, size=(n_outcomes, n_actions, n_outcomes))
    stop = rng.uniform(0.0, 2.0 * stop_prob, size=(horizon, n_outcomes, n_actions)).clip(0.0, 1.0)
    theta = rng.normal(0.0, 1.0, size=(horizon, n_outcomes, n_actions))
    return TabularMDP(transition, reward, success, stop, gamma), theta


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
    action 0) before the last turn and uniform on it.
    """
    X = 2
    transition = np.full((horizon, X, n_actions, X), 1.0 / X)
    reward = np.zeros((horizon, X, n_actions, X))
    success = np.full((X, n_actions, X), 0.5)
    success[:, 0, :], success[:, 1, :] = 0.9, 0.1
    return TabularMDP(transition, reward, success), _confident_logits(horizon, n_actions, confidence, horizon - 1)


def early_variance_mdp(horizon: int = 8, n_actions: int = 3, confidence: float = 0.97, good: float = 0.9,
                       bad: float = 0.1) -> tuple[TabularMDP, np.ndarray]:
    """Most return variance comes from the first decision.

    The first action picks the outcome for good (action 0 → outcome 1, any other → outcome 0); later actions
    change nothing; success has probability ``good`` in outcome 1 and ``bad`` in outcome 0 (drawn on the last
    turn: with 1 and 0 the first move decides everything). The policy is uniform on the first turn and confident
    afterwards.
    """
    X = 2
    transition = np.zeros((horizon, X, n_actions, X))
    transition[0, :, 0, 1] = 1.0
    transition[0, :, 1:, 0] = 1.0
    for x in range(X):
        transition[1:, x, :, x] = 1.0
    reward = np.zeros((horizon, X, n_actions, X))
    success = np.zeros((X, n_actions, X))
    success[:, :, 1], success[:, :, 0] = good, bad
    return TabularMDP(transition, reward, success), _confident_logits(horizon, n_actions, confidence, 0)


def rare_actions_fail_mdp(seed: int = 0, horizon: int = 3, stop_prob: float = 0.0,
                          uncertain_bad_state: bool = True) -> tuple[TabularMDP, np.ndarray]:
    """A negative-control MDP: the likely action 0 (π ≈ 0.86) succeeds with probability 0.9, rare actions with
    0.1. A fork rule that reads a node's own kept turn (its surprisal) forks mostly where the kept turn will fail.
    With ``uncertain_bad_state`` the policy is uniform in outcome 1, a bad state, so surprisal-driven forks
    concentrate there and uniform leaf weights over-count it."""
    mdp, theta = random_mdp(seed, horizon=horizon, stop_prob=stop_prob)
    theta = np.zeros_like(theta)
    theta[..., 0] = 2.5
    success = np.where(np.arange(mdp.n_actions)[None, :, None] == 0, 0.9, 0.1) * np.ones(mdp.success.shape)
    if uncertain_bad_state:
        theta[:, 1, :] = 0.0
        success[1] *= 0.3
    return dataclasses.replace(mdp, success=success, reward=np.zeros_like(mdp.reward)), theta


PROBLEMS: dict[str, Callable[..., tuple[TabularMDP, np.ndarray]]] = {
    "random": random_mdp,
    "late": late_variance_mdp,
    "early": early_variance_mdp,
    "rare_actions_fail": rare_actions_fail_mdp,
}


@functools.lru_cache(maxsize=64)
def _problem(name: str, args: tuple) -> tuple[TabularMDP, np.ndarray]:
    if name not in PROBLEMS:
        raise ValueError(f"tabular problem {name!r} is not one of {sorted(PROBLEMS)}")
    return PROBLEMS[name](**dict(args))


def problem(name: str, **kwargs: object) -> tuple[TabularMDP, np.ndarray]:
    """The named problem (cached: every sandbox of a run shares one MDP object)."""
    return _problem(name, tuple(sorted(kwargs.items())))
