"""Fork budget, limits and selectors (spec §3.3) on scripted candidates."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verl_bpo.branching import (
    BranchingConfig,
    ForkBudget,
    NodeView,
    QuantileSelector,
    TopBWave,
    is_eligible,
)


def view(**kw) -> NodeView:
    base = dict(node_id=1, depth=2, history=(1, 2), parent_turn_surprisal=0.5, forks_on_path=0,
                turns_since_fork=2, horizon_left=3)
    base.update(kw)
    return NodeView(**base)


def test_budget_fills_exactly_n_leaves_and_shortens_the_last_fork():
    budget = ForkBudget(BranchingConfig(n_leaves=7, k=3, k0=2))
    assert budget.leaves_left == 5 and budget.forks_wanted == 3
    for expected in (3, 3, 2):
        children = budget.children_for_fork()
        assert children == expected
        budget.spend(children)
    assert budget.leaves_left == 0 and budget.children_for_fork() == 0
    with pytest.raises(ValueError, match="does not fit"):
        budget.spend(2)


def test_flat_mode_has_no_budget_left():
    config = BranchingConfig(n_leaves=8, k0=8)
    assert config.root_k == 8 and ForkBudget(config).leaves_left == 0


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
    assert is_eligible(view(**node), BranchingConfig(**limits)) is ok


def test_top_b_wave_ranks_within_the_budget_and_the_wave_cap():
    config = BranchingConfig(n_leaves=5, k=2, k0=2, max_forks_per_wave=2)
    picked = TopBWave(config).select(["a", "b", "c", "d"], [0.1, 0.9, 0.5, 0.7], ForkBudget(config))
    assert picked == ["b", "d"]  # best two; the budget (3 leaves) would allow three
    config = BranchingConfig(n_leaves=4, k=3, k0=2)
    assert TopBWave(config).select(["a", "b"], [0.2, 0.3], ForkBudget(config)) == ["b"]  # one fork fills it


def test_quantile_selector_adapts_its_threshold_between_trees():
    config = BranchingConfig(n_leaves=4, k=2, k0=2, selector="quantile")
    selector = QuantileSelector(config)
    assert selector.threshold == -math.inf  # nothing seen yet: fork the first eligible nodes
    selector.end_tree([float(s) for s in range(10)], forks_wanted=2)  # 2 forks among 10 candidates: top 20%
    assert 7.0 < selector.threshold < 8.0
    picked = selector.select(list("abcde"), [1.0, 9.0, 3.0, 8.5, 9.5], ForkBudget(config))
    assert picked == ["b", "d"]  # in arrival order, above τ, until the budget is spent


def test_node_view_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        view().history = (9,)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"k": 1}, "bpo.k"), ({"k0": 9}, "bpo.k0"), ({"score": "vibes"}, "bpo.score"), ({"selector": "x"}, "bpo.selector"),
     ({"n_leaves": 0}, "bpo.n_leaves"), ({"cooldown": -1}, "bpo.cooldown")],
)
def test_bad_branching_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BranchingConfig(**kwargs)


def test_kept_turn_score_is_flagged_as_anticipating():
    assert BranchingConfig(score="kept_turn_surprisal").anticipating
    assert not BranchingConfig(score="parent_turn_surprisal").anticipating
