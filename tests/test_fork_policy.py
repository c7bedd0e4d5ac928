"""The fork rule (core.fork_policy): budget, limits, selectors, and the policy state that persists across trees."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkBudget, ForkPolicy, NodeView, is_eligible


def view(**kw) -> NodeView:
    base = dict(node_id=1, depth=2, history=(1, 2), parent_turn_surprisal=0.5, forks_on_path=0,
                turns_since_fork=2, horizon_left=3)
    base.update(kw)
    return NodeView(**base)


def tree_config(**kw) -> BPOConfig:
    return BPOConfig(mode="tree", **kw)


def test_budget_fills_exactly_n_leaves_and_shortens_the_last_fork():
    plan = ForkPolicy(tree_config(k=3, k0=2)).start_tree(7)
    assert plan.root_width == 2 and plan.leaves_left == 5 and plan.forks_wanted == 3
    for expected in ([3], [3], [2]):
        widths = plan.widths([view()], [1.0])
        assert widths == expected  # reserved when decided: a branch deciding before the fork is made sees it spent
        plan.fork_made(widths[0], widths[0])
    assert plan.leaves_left == 0 and plan.widths([view()], [9.0]) == [1]
    plan.fork_made(3, 1)  # a fork whose snapshot failed gives its two leaves back
    assert plan.leaves_left == 2
    with pytest.raises(ValueError, match="does not fit"):
        ForkBudget(4, 2).spend(4)


def test_flat_mode_has_no_budget_left():
    plan = ForkPolicy(BPOConfig(mode="flat")).start_tree(8)
    assert plan.root_width == 8 and plan.leaves_left == 0


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
    assert policy.start_tree(6).threshold == -math.inf  # kept per leaf count


def test_node_view_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        view().history = (9,)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"k": 1}, "bpo.k"), ({"k0": 0}, "bpo.k0"), ({"score": "vibes"}, "bpo.score"), ({"selector": "x"}, "bpo.selector"),
     ({"cooldown": -1}, "bpo.cooldown"), ({"mode": "forest"}, "bpo.mode"), ({"baseline": "median"}, "bpo.baseline"),
     ({"scale": "batch"}, "bpo.scale"), ({"discount_weighting": "x"}, "bpo.discount_weighting"),
     ({"step_timeout_s": 0}, "bpo.step_timeout_s"), ({"max_tokens_per_turn": 0}, "bpo.max_tokens_per_turn")],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BPOConfig(**kwargs)


def test_leaf_count_errors_name_verls_key():
    with pytest.raises(ValueError, match=r"bpo.k0=9 exceeds actor_rollout_ref.rollout.n=4"):
        tree_config(k0=9).check_leaves(4)
    assert ForkPolicy(tree_config(k0=9)).start_tree(1).root_width == 1  # validation's single session: one episode


def test_posthoc_score_is_flagged_as_anticipating():
    assert BPOConfig(score="kept_turn_surprisal").anticipating
    assert not BPOConfig(score="parent_turn_surprisal").anticipating
