"""Tree math on hand-computed trees and random ones: masses, values, LOO advantages, token painting (T4, T5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trees import random_tree_paths
from verl_bpo.core.config import Ablation, BPOConfig
from verl_bpo.core.tree import Forest, compute_credit, paint_spans

# Root 0 forks into 1, 2 (K0 = 2). Node 1 is a chain node: 1 -> 3, and 3 forks into 4, 5, 6 (K = 3).
#       0
#     /   \
#    1     2 (leaf, r=1)
#    |
#    3 (r=0.5)
#  / | \
# 4  5  6   (r = 1, 0, 0)
PARENT = [-1, 0, 0, 1, 3, 3, 3]
REWARD = [0.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.0]


def test_masses_values_and_loo_on_a_hand_computed_tree():
    credit = compute_credit(Forest(np.array(PARENT), np.array(REWARD)))
    np.testing.assert_allclose(credit.mass, [1, 1 / 2, 1 / 2, 1 / 2, 1 / 6, 1 / 6, 1 / 6])
    # V(3) = mean(1, 0, 0) = 1/3; Q(edge 3) = 0.5 + 1/3; Q(edge 1) = 0 + V(1) = Q(3); Q(edge 2) = 1.
    np.testing.assert_allclose(credit.value[3], 1 / 3)
    np.testing.assert_allclose(credit.q[1], 0.5 + 1 / 3)
    np.testing.assert_allclose(credit.value[0], (0.5 + 1 / 3 + 1.0) / 2)
    # Segments: edges 1 and 3 form one segment under the root fork; 4, 5, 6 are siblings under node 3.
    assert list(credit.segment_top) == [-1, 1, 2, 1, 4, 5, 6]
    a1 = (0.5 + 1 / 3) - 1.0
    np.testing.assert_allclose(credit.advantage[[1, 2, 3]], [a1, -a1, a1])
    np.testing.assert_allclose(credit.advantage[[4, 5, 6]], [1 - 0, 0 - 0.5, 0 - 0.5])


def test_discounting_runs_along_edges_only():
    gamma = 0.5
    credit = compute_credit(Forest(np.array(PARENT), np.array(REWARD)), gamma=gamma)
    v3 = 1 / 3
    np.testing.assert_allclose(credit.q[3], 0.5 + gamma * v3)
    np.testing.assert_allclose(credit.q[1], 0.0 + gamma * (0.5 + gamma * v3))
    # Sibling leaf 2's reward never enters node 3's subtree value.
    np.testing.assert_allclose(credit.value[3], v3)


def test_exact_discount_weighting_scales_by_gamma_to_the_fork_depth():
    forest = Forest(np.array(PARENT), np.array(REWARD))
    seg = compute_credit(forest, gamma=0.5)
    exact = compute_credit(forest, BPOConfig(discount_weighting="exact"), gamma=0.5)
    np.testing.assert_allclose(exact.advantage[[1, 2, 3]], seg.advantage[[1, 2, 3]])  # fork at depth 0
    np.testing.assert_allclose(exact.advantage[[4, 5, 6]], 0.5**2 * seg.advantage[[4, 5, 6]])  # fork at depth 2


def test_mean_incl_self_and_group_std():
    forest = Forest(np.array(PARENT), np.array(REWARD))
    incl = compute_credit(forest, BPOConfig(ablation=Ablation(mean_incl_self=True)))
    np.testing.assert_allclose(incl.advantage[[4, 5, 6]], [1 - 1 / 3, -1 / 3, -1 / 3])
    std = compute_credit(forest, BPOConfig(ablation=Ablation(mean_incl_self=True, group_std=True, epsilon=0.0)))
    sd = np.std([1.0, 0.0, 0.0], ddof=1)
    np.testing.assert_allclose(std.advantage[[4, 5, 6]], np.array([2 / 3, -1 / 3, -1 / 3]) / sd)


def test_a_single_child_root_has_no_baseline_and_gets_zero():
    credit = compute_credit(Forest(np.array([-1, 0, 1]), np.array([0.0, 1.0, 2.0])))
    np.testing.assert_array_equal(credit.advantage, 0.0)


def test_forest_rejects_children_before_parents():
    with pytest.raises(ValueError, match="parent must come before"):
        Forest(np.array([-1, 2, 0]), np.zeros(3))


def test_gamma_outside_the_unit_interval_names_verls_key():
    with pytest.raises(ValueError, match="algorithm.gamma"):
        compute_credit(Forest(np.array(PARENT), np.array(REWARD)), gamma=1.5)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_leaves=st.integers(2, 12), k0=st.integers(2, 4))
def test_T5_masses_sum_to_one_and_leaf_count_matches_forks(seed, n_leaves, k0):
    rng = np.random.default_rng(seed)
    k0 = min(k0, n_leaves)
    parent, leaves = random_tree_paths(rng, n_leaves, k0, k_choices=(2, 3, 4))
    forest = Forest(np.array(parent), rng.normal(size=len(parent)))
    credit = compute_credit(forest)
    leaf = forest.is_leaf
    np.testing.assert_allclose(credit.mass[leaf].sum(), 1.0)
    k = forest.num_children
    assert leaf.sum() == 1 + (k[k >= 1] - 1).sum() == len(leaves)  # N = 1 + Σ(K − 1)
    # W_e = Σ of leaf masses below e.
    below = np.where(leaf, credit.mass, 0.0)
    for level in reversed(forest.levels()[1:]):
        np.add.at(below, forest.parent[level], below[level])
    np.testing.assert_allclose(below, credit.mass)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_T4_baseline_independence(seed):
    """∂b_e/∂Q̂_e = 0: changing one leaf's reward changes only the advantages on its path and of their siblings."""
    rng = np.random.default_rng(seed)
    parent, leaves = random_tree_paths(rng, 8, 2, k_choices=(2, 3))
    reward = rng.normal(size=len(parent))
    forest = Forest(np.array(parent), reward)
    base = compute_credit(forest)
    leaf = leaves[int(rng.integers(len(leaves)))][-1]
    bumped = reward.copy()
    bumped[leaf] += 1.0
    after = compute_credit(Forest(np.array(parent), bumped))
    changed = set(np.flatnonzero(~np.isclose(after.advantage, base.advantage)))
    path = set()
    n = leaf
    while n > 0:
        path.add(n)
        n = parent[n]
    tops_on_path = {base.segment_top[n] for n in path}
    siblings = {c for c in range(1, len(parent)) for t in tops_on_path if parent[c] == parent[t]}
    segment_members = {n for n in range(1, len(parent)) if base.segment_top[n] in siblings}
    assert changed <= segment_members
    # The LOO baseline of the segment containing the leaf is unchanged: the advantage moved by exactly Δq.
    top = base.segment_top[leaf]
    dq = after.q[top] - base.q[top]
    np.testing.assert_allclose(after.advantage[top] - base.advantage[top], dq)


def test_paint_spans_exactly():
    out, twice = paint_spans((2, 8), np.array([0, 0, 1]), np.array([0, 3, 5]), np.array([3, 4, 8]),
                             np.array([0.1, -2.0, 7.0]), np.array([0.2, -4.0, 14.0]))
    expected = np.zeros((2, 8))
    expected[0, 0:3], expected[0, 3:4], expected[1, 5:8] = 0.1, -2.0, 7.0
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected.astype(np.float32))
    np.testing.assert_array_equal(twice, (2 * expected).astype(np.float32))
