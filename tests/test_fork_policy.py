"""The fork rule (core.fork_policy): the tree budget, limits, selectors, and the policy state that persists across
trees."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy, NodeView, TreeBudget, is_eligible


def view(**kw) -> NodeView:
    base = dict(node_id=1, depth=2, history=(1, 2), parent_turn_surprisal=0.5, forks_on_path=0,
                turns_since_fork=2, horizon_left=3, budget=1.0)
    base.update(kw)
    return NodeView(**base)


def tree_config(**fixed) -> BPOConfig:
    limits = {key: fixed.pop(key) for key in ("min_depth", "max_forks_per_path", "cooldown") if key in fixed}
    return BPOConfig(mode="tree", fixed=fixed, **limits)


def test_budget_fills_exactly_n_leaves_and_shortens_the_last_fork():
    plan = ForkPolicy(tree_config(k=3, k0=2)).start_tree(7)
    budget = plan.budget
    assert plan.root_width == 2 and budget.leaves_left == 5 and plan.forks_wanted == 3
    for expected in ([3], [3], [2]):
        widths = plan.widths([view()], [1.0])
        assert widths == expected  # reserved when decided: a branch deciding before the fork is made sees it spent
        budget.on_fork(1.0, widths[0], widths[0])
    assert budget.leaves_left == 0 and plan.widths([view()], [9.0]) == [1]
    budget.on_fork(1.0, 3, 1)  # a fork whose snapshot failed gives its two leaves back
    assert budget.leaves_left == 2
    with pytest.raises(ValueError, match="does not fit"):
        budget.reserve(4)


def test_flat_mode_has_no_leaves_left():
    plan = ForkPolicy(BPOConfig(mode="flat")).start_tree(8)
    assert plan.root_width == 8 and plan.budget.leaves_left == 0


def test_leaf_amounts_flow_down_the_tree_and_back_through_the_pool():
    """A fork splits its node's leaves (each branch keeps the one it ends as, topping up from the pool when the node
    holds fewer), an ended branch returns the rest, and a running branch takes its share of it."""
    budget = TreeBudget("leaves", 8, 8)
    budget.reserve(2)
    assert budget.on_fork(8.0, 2, 2) == [4.0, 4.0]
    budget.reserve(3)
    assert budget.on_fork(4.0, 3, 3) == [2.0, 1.0, 1.0] and budget.leaves_left == 4
    assert budget.on_turn(2.0, tokens=50) == 2.0 and budget.spent == 0.0  # a turn costs no leaves
    budget.on_leaf_end(2.0)
    assert budget.pool == 1.0 and budget.on_node(1.0, running=3) == 2.0 and budget.pool == 0.0
    assert budget.on_fork(1.0, 3, 3) == [1.0, 1.0, 1.0] and budget.pool == -2.0  # the fixed rule forks by the cap
    turns = TreeBudget("turns", 12.0, 32)
    assert turns.on_fork(12.0, 3, 3) == [4.0, 4.0, 4.0] and turns.on_turn(4.0, tokens=50) == 3.0
    turns.on_leaf_end(3.0)
    assert turns.on_node(4.0, running=2) == 5.5 and turns.pool == 1.5 and turns.spent == 1.0


@pytest.mark.parametrize(
    "limits,node,ok",
    [
        ({}, {}, True),
        ({"min_depth": 3}, {"depth": 2}, False),
        ({"max_forks_per_path": 1}, {"forks_on_path": 1}, False),
        ({"cooldown": 2}, {"turns_since_fork": 2}, False),
        ({"cooldown": 2}, {"turns_since_fork": 3}, True),
        ({}, {"horizon_left": 0}, False),
        ({"min_depth": 0}, {"depth": 0}, False),  # the root fork is K0, never a scored fork
    ],
)
def test_eligibility_limits(limits, node, ok):
    assert is_eligible(view(**node), tree_config(**limits)) is ok


def test_top_b_wave_ranks_within_the_budget_and_the_wave_cap():
    plan = ForkPolicy(tree_config(k=2, k0=2, max_forks_per_wave=2)).start_tree(5)
    assert plan.widths([view()] * 4, [0.1, 0.9, 0.5, 0.7]) == [1, 2, 1, 2]  # best two; the budget would allow 3
    plan = ForkPolicy(tree_config(k=3, k0=2)).start_tree(4)
    assert plan.widths([view()] * 2, [0.2, 0.3]) == [1, 3]  # one fork of 3 fills the 2 leaves left


def test_quantile_threshold_persists_across_trees_and_learns_only_from_finished_ones():
    policy = ForkPolicy(tree_config(k=2, k0=2, selector="quantile"))
    first = policy.start_tree(4)
    assert first.threshold == -math.inf  # nothing seen yet: fork the first eligible nodes
    first.widths([view()] * 10, [float(s) for s in range(10)])  # 2 forks wanted among 10 candidates: the top 20%
    second = policy.start_tree(4)  # started before the first finished: still the old threshold
    policy.finish_tree(first)
    assert second.threshold == -math.inf and 7.0 < policy.threshold[4] < 8.0
    third = policy.start_tree(4)
    assert third.widths([view()] * 5, [1.0, 9.0, 3.0, 8.5, 9.5]) == [1, 2, 1, 2, 1]  # in order, above τ, in budget
    assert policy.start_tree(6).threshold == -math.inf  # kept per N


def test_node_view_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        view().history = (9,)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"fixed": {"k": 1}}, "bpo.fixed.k"), ({"fixed": {"k0": 0}}, "bpo.fixed.k0"),
     ({"fixed": {"score": "vibes"}}, "bpo.fixed.score"), ({"fixed": {"selector": "x"}}, "bpo.fixed.selector"),
     ({"cooldown": -1}, "bpo.cooldown"), ({"mode": "forest"}, "bpo.mode"),
     ({"ablation": {"epsilon": -1.0}}, "bpo.ablation.epsilon"), ({"discount_weighting": "x"}, "bpo.discount_weighting"),
     ({"step_timeout_s": 0}, "bpo.step_timeout_s"), ({"max_tokens_per_turn": 0}, "bpo.max_tokens_per_turn")],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BPOConfig(**kwargs)


def test_leaf_count_errors_name_verls_key():
    with pytest.raises(ValueError, match=r"bpo.fixed.k0=9 exceeds actor_rollout_ref.rollout.n=4"):
        tree_config(k0=9).check_leaves(4)
    assert ForkPolicy(tree_config(k0=9)).start_tree(1).root_width == 1  # validation's single session: one episode


def test_posthoc_score_is_flagged_as_anticipating():
    assert BPOConfig(ablation={"kept_turn_surprisal": True}).anticipating
    assert not BPOConfig(fixed={"score": "parent_turn_surprisal"}).anticipating
