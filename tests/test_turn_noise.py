"""The turn-noise diagnostic's two score models (``benchmarks/turn_noise.py``) on hand-built turns, no model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
noise = pytest.importorskip("turn_noise")


def test_opposite_coefficients_on_the_same_tokens_cancel_only_when_scores_are_coherent():
    # Two flat episodes of one walk turn ("east", token 7) and a door (tokens 3 and 4), leave-one-out advantages
    # +0.5 and -0.5: the walks say the same thing, so a shared score cancels; independent scores add.
    turns = [("a1", [7], [0.5], "walk"), ("a2", [3], [0.5], "last"),
             ("b1", [7], [-0.5], "walk"), ("b2", [4], [-0.5], "last")]
    out = noise.noise_energies(turns)
    assert out["walk"] == {"independent": 0.5, "coherent": 0.0}
    assert out["last"] == {"independent": 0.5, "coherent": 0.5}


def test_a_turn_shared_by_leaves_sums_its_coefficients_before_squaring():
    # Node "w" is shared by two leaves (rows), each giving its tokens 0.25: one turn of coefficient 0.5.
    turns = [("w", [7, 8], [0.25, 0.25], "walk"), ("d1", [3], [1.0], "last"),
             ("w", [7, 8], [0.25, 0.25], "walk"), ("d2", [4], [-1.0], "last")]
    out = noise.noise_energies(turns)
    assert out["walk"]["independent"] == pytest.approx(2 * 0.5 ** 2)
    assert out["walk"]["coherent"] == pytest.approx(2 * 0.5 ** 2)
    assert out["last"] == {"independent": 2.0, "coherent": 2.0}


def test_a_leafs_last_turn_is_its_last_part_and_every_other_its_walk():
    assert [noise.turn_part(k, 3) for k in range(3)] == ["walk", "walk", "last"]
    assert noise.turn_part(0, 1) == "last"
