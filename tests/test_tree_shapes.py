"""The tree-shape diagnostic's fork account (``benchmarks/tree_shapes.py``) on hand-built trees, no model."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
shapes = pytest.importorskip("tree_shapes")

# A root fork of 2 (nodes 1, 2); below node 1 a fork of 3 at depth 1 (its children win 1, 0, 0); below node 2 a
# fork of 2 at depth 2 whose children both win 0 (a fork that averaged nothing).
PATHS = [(0, 1, 3), (0, 1, 4), (0, 1, 5), (0, 2, 6, 7), (0, 2, 6, 8)]
RETURNS = [1.0, 0.0, 0.0, 0.0, 0.0]


def test_forks_widths_and_decisive_forks_per_depth():
    by_depth = shapes.fork_account([(PATHS, RETURNS)])
    assert by_depth == {0: {"forks": 1, "width": 2.0, "forks_decisive": 1},
                        1: {"forks": 1, "width": 3.0, "forks_decisive": 1},
                        2: {"forks": 1, "width": 2.0, "forks_decisive": 0}}
    assert shapes.decisive_share(by_depth) == 0.5


def test_a_flat_group_forks_only_at_the_root_and_ties_are_not_decisive():
    flat = [(0, i, 10 + i) for i in range(1, 5)]
    by_depth = shapes.fork_account([(flat, [0.0] * 4), (flat, [1.0, 0.0, 0.0, 0.0])])
    assert by_depth == {0: {"forks": 2, "width": 4.0, "forks_decisive": 1}}
    assert math.isnan(shapes.decisive_share(by_depth))
