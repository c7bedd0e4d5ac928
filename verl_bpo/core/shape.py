"""The tree shape a learned plan aims for: per-depth fork widths that minimise the gradient variance of
leave-one-out sibling advantages within a budget. Pure numpy.

A shape gives every node at depth d the width K_d (K_0 is the root's, K_d = 1 where no fork is made), so
n_j = Π_{d≤j} K_d samples of the depth-j turn are drawn per path alive there. The turn at depth i belongs to the
segment of the last fork u(i) ≤ i, and its advantage compares the segment's value with those of its K_u − 1
siblings (:func:`verl_bpo.core.tree.compute_credit`). Its variance is therefore f_u = K_u / (K_u − 1) times the
variance of one segment value, which holds the return variance injected at and after u, averaged over the samples
there. The baseline removes what was injected before u. With ē_i the gradient mass of a depth-i turn and D_j the
return variance the depth-j turn injects (:class:`~verl_bpo.core.profile.DepthProfile`), the score-function
gradient's variance is

    V(K) = Σ_i ē_i f_{u(i)} Σ_{j≥u(i)} D_j / n_j  =  Σ_j (D_j / n_j) H_j,     H_j = Σ_{i < end(j)} ē_i f_{u(i)},

end(j) being the depth where the segment holding j ends. So noise injected at depth j reaches every turn above
it and every turn of its own segment, each through its fork's leave-one-out factor; a narrow root (f = 2 for
K_0 = 2) doubles what every first turn carries, which the ideal-baseline model does not see. The cost is
Σ_j q_j n_j, with q_j = S_j c_j (turns, tokens: S_j the share of episodes that take a depth-j turn, c_j its cost)
or S_j − S_{j+1} (leaves: the paths that end after the depth-j turn).

The flat shape K_0 = N, the others 1, is RLOO. It is always a candidate, so under the model the shape chosen
is never worse than RLOO within the same budget.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["Shape", "candidate_widths", "shape_variance", "shape_cost", "best_shape"]

# Non-root widths the search tries. With at most MAX_SEARCH_FORKS forks below the root, placed at no more than
# MAX_FORK_DEPTHS depths (evenly spread when the horizon is longer), the candidates stay below about 65 000 (18 000
# for 8 turns and 128 leaves), so a plan is chosen in milliseconds whatever bpo.max_turns is.
_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
MAX_SEARCH_FORKS = 3
MAX_FORK_DEPTHS = 11


@dataclasses.dataclass(frozen=True)
class Shape:
    """The chosen shape.

    Attributes:
        widths: ``(T,)`` K_d per node depth.
        variance: V of the shape (model units).
        flat_variance: V of the flat shape within the same budget (RLOO's); the ratio is what the plan predicts.
        cost: Σ_j q_j n_j.
    """

    widths: np.ndarray
    variance: float
    flat_variance: float
    cost: float


@functools.lru_cache(maxsize=64)
def candidate_widths(horizon: int, cap: int, first_depth: int, cooldown: int, max_forks: int) -> np.ndarray:
    """``(M, horizon)`` int widths: a root of 2 .. ``cap``, then at most ``max_forks`` forks at depths
    ≥ ``first_depth`` (at most ``MAX_FORK_DEPTHS`` of them, evenly spread), more than ``cooldown`` turns apart, with
    at most ``cap`` leaves (Π K ≤ cap). Cached."""
    rows: list[tuple[int, ...]] = []
    depths = range(first_depth, horizon)
    if len(depths) > MAX_FORK_DEPTHS:
        depths = np.unique(np.round(np.linspace(first_depth, horizon - 1, MAX_FORK_DEPTHS)).astype(int))
    fork_depths = set(int(d) for d in depths)

    def extend(prefix: list[int], product: int, forks: int, last_fork: int) -> None:
        depth = len(prefix)
        if depth == horizon:
            rows.append(tuple(prefix))
            return
        allowed = depth in fork_depths and forks < max_forks and depth - last_fork > cooldown
        for k in _WIDTHS if allowed else (1,):
            if product * k > cap:
                break
            extend(prefix + [k], product * k, forks + (k > 1), depth if k > 1 else last_fork)

    for root in range(2, max(cap, 2) + 1):
        extend([root], root, 0, 0)
    return np.array(rows, dtype=np.int64).reshape(-1, horizon)


def shape_variance(widths: np.ndarray, injected: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """V of each row of ``widths`` ``(M, T)`` (module docstring), from D_j = ``injected`` and ē_j = ``mass``."""
    widths = np.asarray(widths, dtype=np.float64)
    m, T = widths.shape
    samples = np.cumprod(widths, axis=1)  # n_j
    forks = widths > 1
    forks[:, 0] = True
    depth = np.arange(T)
    # u(i): the last fork at or above i; its leave-one-out factor f.
    fork_depth = np.maximum.accumulate(np.where(forks, depth, 0), axis=1)
    k_u = np.take_along_axis(widths, fork_depth, axis=1)
    factor = k_u / (k_u - 1.0)
    # end(j): the depth of the next fork below j (T if none); H_j = Σ_{i < end(j)} ē_i f_{u(i)}.
    next_fork = np.where(forks, depth, T)
    end = np.minimum.accumulate(np.concatenate([next_fork[:, 1:], np.full((m, 1), T)], axis=1)[:, ::-1],
                                axis=1)[:, ::-1]
    carried = np.concatenate([np.zeros((m, 1)), np.cumsum(mass * factor, axis=1)], axis=1)
    reach = np.take_along_axis(carried, end, axis=1)
    return (injected / samples * reach).sum(axis=1)


def shape_cost(widths: np.ndarray, per_sample: np.ndarray) -> np.ndarray:
    """Σ_j q_j n_j of each row of ``widths``, q = ``per_sample``."""
    return np.cumprod(np.asarray(widths, dtype=np.float64), axis=1) @ per_sample


def best_shape(candidates: np.ndarray, injected: np.ndarray, mass: np.ndarray, per_sample: np.ndarray,
               budget: float, rollout_n: int) -> Shape:
    """The candidate of least V whose cost fits ``budget``; the flat shape of ``rollout_n`` roots (N, RLOO) unless
    one does better."""
    T = candidates.shape[1]
    flat = np.ones((1, T), dtype=np.int64)
    flat[0, 0] = rollout_n
    flat_variance = float(shape_variance(flat, injected, mass)[0])
    cost = shape_cost(candidates, per_sample)
    fits = np.flatnonzero(cost <= budget * (1 + 1e-9))
    if fits.size == 0:
        return Shape(flat[0], flat_variance, flat_variance, float(shape_cost(flat, per_sample)[0]))
    variance = shape_variance(candidates[fits], injected, mass)
    best, chosen = fits[int(np.argmin(variance))], float(variance.min())
    if chosen >= flat_variance:
        return Shape(flat[0], flat_variance, flat_variance, float(shape_cost(flat, per_sample)[0]))
    return Shape(candidates[best].copy(), chosen, flat_variance, float(cost[best]))
