"""The learned allocation (core.profile + the learned plans of core.fork_policy) on known problems.

The profile must find where each tabular problem injects its return variance, and the allocation must follow it:
a tree whose outcome is decided by its first move becomes flat (K0 = N, exactly RLOO), one decided by its last
move keeps a narrow root and spends its budget on the last turn. Exploration trees keep their fixed shape.
"""

from __future__ import annotations

import numpy as np
import pytest

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import AllocationPlan, ExplorePlan, ForkPolicy, NodeView
from verl_bpo.core.profile import DepthProfile, TreeRecord
from verl_bpo.oracle.estimates import sample_trees

N, T = 16, 8
# `slow` (outside the fast tier): the tests that grow hundreds of trees to learn a profile; the fast tier keeps the
# hand-built checks and one short learned run.


def learned(**kw) -> BPOConfig:
    """A learned allocation over T turns; ``kw`` are ``bpo.learned`` fields (128 leaves at most unless a leaf
    budget)."""
    if kw.get("budget_unit") != "leaves":
        kw = {"max_leaves": 128, **kw}
    return BPOConfig(mode="tree", allocation="learned", max_turns=T, learned=kw)


def test_variogram_by_split_depth_on_a_hand_built_tree():
    # Root 0 -> 1, 2; node 1 -> 3 -> (5, 6) splits at depth 2; node 2 -> 4 is a leaf.
    record = TreeRecord(leaf_paths=[(0, 1, 3, 5), (0, 1, 3, 6), (0, 2, 4)], leaf_returns=[1.0, 0.0, 1.0],
                        leaf_masses=[0.25, 0.25, 0.5], turn_uncertainty={}, turn_tokens={}, score_free=True)
    profile = DepthProfile(horizon=4, prior=0.0, window=10**6)
    profile.update(record)
    # Depth 0 pairs: (5, 4): 0, (6, 4): 0.5 -> mean 0.25; depth 2 pair: (5, 6): 0.5.
    np.testing.assert_allclose(profile._gamma[[0, 2]], [0.25, 0.5])
    np.testing.assert_allclose(profile.survival, [1.0, 1.0, 0.5, 0.0])  # mass-weighted: the turn at depth 2 on half

    mean, _, trees = profile.variogram()
    np.testing.assert_allclose(mean[[0, 2]], [0.25, 0.5])
    trees[:] = 0.0  # the caller's copy: the profile's own counts stay
    assert profile.variogram()[2][0] > 0


def test_variogram_weights_pairs_by_their_leaves_masses():
    # Root fork of 3: child 1 forks again into leaves 4, 5 (mass 1/6 each); children 2, 3 are leaves (mass 1/3).
    record = TreeRecord(leaf_paths=[(0, 1, 4), (0, 1, 5), (0, 2), (0, 3)], leaf_returns=[1.0, 1.0, 0.0, 0.0],
                        leaf_masses=[1 / 6, 1 / 6, 1 / 3, 1 / 3], turn_uncertainty={}, turn_tokens={},
                        score_free=True)
    profile = DepthProfile(horizon=3, prior=0.0, window=10**6)
    profile.update(record)
    # Depth-0 pairs: four (1-subtree, 2 or 3) pairs of ½ at weight 1/18, one (2, 3) pair of 0 at weight 1/9:
    # 1/3, the value of three independent root samples (the unweighted mean of the five pairs would be 0.4).
    np.testing.assert_allclose(profile._gamma[0], 1 / 3)


def split_at(depth: int, returns: tuple[float, float], horizon: int = T) -> TreeRecord:
    """Two leaves of ``horizon`` turns whose paths share the first ``depth`` turns, then part."""
    shared = tuple(range(depth + 1))
    paths = [shared + tuple(100 * leaf + j for j in range(depth + 1, horizon + 1)) for leaf in (1, 2)]
    return TreeRecord(leaf_paths=paths, leaf_returns=list(returns), leaf_masses=[0.5, 0.5],
                      turn_uncertainty={node: 0.3 for path in paths for node in path}, turn_tokens={},
                      score_free=True, plan="explore")


def walk_then_door() -> list[TreeRecord]:
    """A task decided by its last turn (depth 7): a root split and a door split see the same return variance (¼);
    two walk depths were split by three trees each, which by chance saw ½ at depth 2 and 0 at depth 3."""
    records = [split_at(d, (1.0, 0.0) if i % 2 else (0.0, 0.0)) for i in range(40) for d in (0, 7)]
    return records + [split_at(2, (1.0, 0.0)) for _ in range(3)] + [split_at(3, (0.0, 0.0)) for _ in range(3)]


def test_a_walk_split_by_a_few_trees_does_not_read_as_a_decision():
    """The conditional return variance cannot grow with depth, so the variogram is fitted non-increasing: the few
    trees at depths 2 and 3 pool with the many at 0 and 7, and only the door injects variance. (Differencing the
    raw means put ½ at depth 2, above the door's ¼, and forks went to the walk.)"""
    profile = DepthProfile(horizon=T, prior=0.0, window=10**6)
    for record in walk_then_door():
        profile.update(record)
    injected = profile.injected_variance()
    assert np.all(injected[:7] == 0) and injected[7] > 0.15


def test_a_learned_plan_forks_only_at_its_shapes_depths_whatever_a_node_holds():
    """A node handed more than its shape planned (paths that ended early leave a surplus) keeps it for the next
    depth the shape forks at, instead of forking where the model buys nothing."""
    policy = ForkPolicy(learned(warmup_trees=0, explore_share=0.0, budget_unit="turns"))
    for record in walk_then_door():
        policy.learn(record)
    plan = policy.start_tree(N, seed=0)
    assert isinstance(plan, AllocationPlan) and plan.shape.widths[3] == 1 and plan.shape.widths[7] > 1

    def view(depth: int, budget: float) -> NodeView:
        return NodeView(node_id=depth, depth=depth, history=(), parent_turn_surprisal=0.1, forks_on_path=0,
                        turns_since_fork=depth, horizon_left=T - depth, budget=budget)

    rich = 20 * plan.planned[3]
    assert plan.widths([view(3, rich)], [0.0]) == [1]
    assert plan.widths([view(7, plan.planned[7])], [0.0])[0] > 1


def test_an_exploration_tree_forks_all_its_root_paths_at_one_depth():
    """One fork depth per tree (drawn uniformly), so its root siblings' identical routine turns cancel as RLOO's
    do; across trees every depth is explored."""
    results, _ = grow("late", learned(warmup_trees=40), 40)
    depths_seen = set()
    for result in results:
        by_root: dict[int, list] = {}
        for leaf in result.leaves:
            by_root.setdefault(leaf.meta.node_path[1], []).append(leaf.meta.node_path)
        depths = {next(j for j in range(1, len(a)) if a[j] != b[j]) - 1 for a, b in
                  (paths for paths in by_root.values() if len(paths) == 2)}
        assert len(depths) == 1
        depths_seen |= depths
    assert depths_seen == set(range(1, T))


def grow(regime: str, config: BPOConfig, n_trees: int, seed: int = 0, **problem_args):
    policy = ForkPolicy(config)
    return sample_trees(regime, problem_args, config, N, n_trees, seed=seed, policy=policy), policy


def shape(result) -> dict:
    paths = [leaf.meta.node_path for leaf in result.leaves]
    root_children = {p[1] for p in paths}
    return {"root": len(root_children), "leaves": len(paths)}


@pytest.mark.slow
def test_a_first_move_decision_makes_the_tree_flat_exactly_rloo():
    results, policy = grow("early", learned(warmup_trees=200, explore_share=0.0), 260, good=1.0, bad=0.0)
    injected = policy.profile.injected_variance()
    assert injected[0] > 0.1 and np.all(injected[1:] == 0)  # the first turn injects all the variance
    for result in results[200:]:
        assert shape(result) == {"root": N, "leaves": N}  # K0 = N and no later fork


@pytest.mark.slow
def test_first_move_with_a_coin_flip_at_the_end_forks_the_last_turn_too():
    results, policy = grow("early", learned(warmup_trees=200, explore_share=0.0), 260)
    injected = policy.profile.injected_variance()
    assert injected[0] > 0 and injected[-1] > 0 and np.all(injected[1:-1] < 0.2 * injected[0])
    assert np.mean([shape(r)["root"] for r in results[200:]]) > N / 2  # most of the budget still at the root


@pytest.mark.slow
def test_a_last_move_decision_keeps_a_narrow_root_and_forks_the_last_turn():
    results, policy = grow("late", learned(warmup_trees=200, explore_share=0.0), 260)
    injected = policy.profile.credited_variance()
    assert injected[-1] > 0.8 * injected.sum()
    roots = [shape(r)["root"] for r in results[200:]]
    # A narrow root, but wider than 2: a root of 2 takes each first turn's baseline from one sibling, doubling
    # the last turn's noise that every earlier turn's advantage carries.
    assert 2 < np.mean(roots) < N / 3
    for result in results[200:]:
        assert min(leaf.meta.num_turns for leaf in result.leaves) == T  # every path runs to the end
        assert shape(result)["leaves"] > 4 * N  # the budget of N·T turns buys many last-turn samples
    predicted = [r.metrics["bpo/predicted_variance_ratio"] for r in results[200:]]
    assert max(predicted) < 0.6  # the model expects the shape to beat RLOO within the same budget, and logs it
    assert policy.metrics()["bpo/profile/gradient_mass/d7"] > 0
    steps = [r.metrics["bpo/env_steps"] for r in results[200:]]
    assert 0.9 * N * T < np.mean(steps) < 1.02 * N * T  # ... and spends the turn budget, no more


def test_turn_budget_and_leaf_cap_are_kept():
    config = learned(warmup_trees=50, explore_share=0.0, max_leaves=24)
    results, _ = grow("late", config, 120)
    leaves = [len(r.leaves) for r in results[50:]]
    assert max(leaves) <= 24 and min(leaves) >= N and np.mean(leaves) > N  # capped, and more leaves than N
    leaf_budget, _ = grow("late", learned(warmup_trees=50, explore_share=0.0, budget_unit="leaves"), 120)
    assert {len(r.leaves) for r in leaf_budget[50:]} == {N}  # exactly N leaves


def test_no_node_is_starved_of_leaves_by_the_nodes_that_forked_first():
    """A node forks within its share of the leaf cap (cap · ω over the leaves planned below each child), so the
    nodes reached first, rounded up by the budget they hold, cannot spend the leaves of those reached last. Before
    shares, with 8 rollouts' budget and 16 leaves the shape (4 roots, forks of 4 at the door) was grown with three
    forks of 5 and one of 1 in 14 of these 40 trees: one leaf weighed 5 times its cousins, the trees' variance
    factor L · Σ ω² was 1.23 on average, and a leaf's weight followed which branch came first."""
    config = learned(warmup_trees=50, explore_share=0.0, budget_unit="turns", max_leaves=16)
    results = sample_trees("late", {}, config, 8, 90, seed=0, policy=ForkPolicy(config))
    masses = [np.array([leaf.meta.leaf_mass for leaf in r.leaves]) for r in results[50:]]
    assert max(len(m) for m in masses) == 16  # the cap is reached: the case where nodes compete for it
    assert max(m.max() / m.min() for m in masses) <= 1.5
    factors = [r.metrics["bpo/leaf_mass_factor"] for r in results[50:]]
    assert factors == pytest.approx([len(m) * (m ** 2).sum() for m in masses]) and np.mean(factors) < 1.05


@pytest.mark.slow
def test_exploration_trees_have_the_fixed_shape_and_fork_depths_spread_evenly():
    results, policy = grow("late", learned(warmup_trees=400), 400)
    fork_depths = []
    # The first batch of 64 concurrent trees starts before the profile knows what an episode costs.
    assert {shape(result)["root"] for result in results[:64]} == {N // 2}
    roots = {shape(result)["root"] for result in results[64:]}
    assert len(roots) == 2 and max(roots) - min(roots) == 1 and min(roots) > N // 2  # stochastic rounding of R
    steps = [r.metrics["bpo/env_steps"] for r in results[64:]]
    assert 0.9 * N * T < np.mean(steps) < 1.1 * N * T  # the root paths and their forks fill the turn budget
    leaf_budget, _ = grow("late", learned(warmup_trees=20, budget_unit="leaves"), 20)
    assert {shape(result)["root"] for result in leaf_budget} == {N // 2}
    for result in results:
        by_root: dict[int, list] = {}
        for leaf in result.leaves:
            by_root.setdefault(leaf.meta.node_path[1], []).append(leaf.meta.node_path)
        for paths in by_root.values():
            assert len(paths) <= 2  # one fork of 2 at most below each root path
            if len(paths) == 2:
                a, b = paths
                fork_depths.append(next(j for j in range(1, len(a)) if a[j] != b[j]) - 1)
    counts = np.bincount(fork_depths, minlength=T)[1:]
    assert counts.min() > 0.6 * counts.mean()  # uniform over depths 1 .. T-1
    assert policy.profile.variogram_trees > 0.5 * 400  # every tree taught the variogram (weights decay slowly)


def test_the_policy_explores_during_warm_up_then_on_a_share_of_trees():
    policy = ForkPolicy(learned(warmup_trees=10, explore_share=0.25))
    plans = [policy.start_tree(N, seed=s) for s in range(410)]
    assert all(isinstance(p, ExplorePlan) for p in plans[:10])
    share = np.mean([isinstance(p, ExplorePlan) for p in plans[10:]])
    assert 0.18 < share < 0.32 and all(isinstance(p, (ExplorePlan, AllocationPlan)) for p in plans)


def test_a_learned_plan_reads_only_the_view_and_its_randomness():
    """Same view, same seed, same width; the node's history and score are never read."""
    policy = ForkPolicy(learned(warmup_trees=0, explore_share=0.0))
    view = NodeView(node_id=3, depth=2, history=(1, 2, 3), parent_turn_surprisal=0.1, forks_on_path=0,
                    turns_since_fork=2, horizon_left=6, budget=40.0)
    other = NodeView(node_id=9, depth=2, history=(7, 7), parent_turn_surprisal=9.0, forks_on_path=0,
                     turns_since_fork=2, horizon_left=6, budget=40.0)
    first = policy.start_tree(N, seed=1).widths([view], [0.0])
    assert policy.start_tree(N, seed=1).widths([other], [5.0]) == first


@pytest.mark.slow
def test_an_explicit_budget_replaces_the_learned_one_and_sizes_the_shape():
    """A tree handed a budget (a paired baseline's tokens on the task) plans within it, not within N flat
    rollouts' worth; a larger budget buys a costlier shape, and exploration trees record it too."""
    results, policy = grow("late", learned(warmup_trees=200, explore_share=0.0), 200)
    learned_budget = policy.start_tree(N, seed=0).budget.root_budget
    assert learned_budget == pytest.approx(N * policy.profile.episode_cost("turns"))
    small, large = (policy.start_tree(N, seed=1, root_budget=b) for b in (0.5 * learned_budget, 2.0 * learned_budget))
    assert isinstance(large, AllocationPlan) and (small.budget.root_budget, large.budget.root_budget) == (
        0.5 * learned_budget, 2.0 * learned_budget)
    assert (small.shape.cost <= small.budget.root_budget * (1 + 1e-9) < large.shape.cost
            <= large.budget.root_budget * (1 + 1e-9))
    explore = ForkPolicy(learned(warmup_trees=5)).start_tree(N, seed=0, root_budget=77.0)
    assert isinstance(explore, ExplorePlan) and explore.budget.root_budget == 77.0


def test_turn_costs_follow_the_policy_within_the_cost_window_and_the_variogram_keeps_its_memory():
    """A policy whose turns grew from 2 to 6 tokens: after a few cost windows the profile plans on 6, so a token
    budget is kept; the variogram still remembers the trees before."""
    def record(tokens: float, returns: tuple[float, float]) -> TreeRecord:
        return TreeRecord(leaf_paths=[(0, 1, 3), (0, 2, 4)], leaf_returns=list(returns), leaf_masses=[0.5, 0.5],
                          turn_uncertainty={}, turn_tokens={n: tokens for n in range(1, 5)}, score_free=True)

    profile = DepthProfile(horizon=2, prior=0.0, window=500, cost_window=8)
    for _ in range(200):
        profile.update(record(2.0, (1.0, 0.0)))
    for _ in range(40):
        profile.update(record(6.0, (1.0, 1.0)))
    assert profile.turn_cost("tokens") == pytest.approx([6.0, 6.0], rel=0.01)  # e^-5 of the old length is left
    assert profile.episode_cost("tokens") == pytest.approx(12.0, rel=0.01)
    # The variogram's window is 500 trees: the 200 trees that split outcomes (½ each) still weigh about 5 to 1.
    assert 0.3 < profile._gamma[0] / profile._gamma_trees[0] < 0.45
    single = DepthProfile(horizon=2, prior=0.0, window=500)  # one window for both: the length lags
    for tokens, n in ((2.0, 200), (6.0, 40)):
        for _ in range(n):
            single.update(record(tokens, (1.0, 0.0)))
    assert single.turn_cost("tokens")[0] < 3.0
