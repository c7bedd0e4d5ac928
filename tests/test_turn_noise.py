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


def test_rare_tokens_split_off_by_their_sampled_probability():
    logprobs = [-0.1, -4.0, -2.0]  # probabilities 0.90, 0.018, 0.135
    assert noise.token_parts(0, 2, logprobs) == ["walk"] * 3
    assert noise.token_parts(0, 2, logprobs, 0.05) == ["walk_common", "walk_rare", "walk_common"]
    assert noise.token_parts(1, 2, logprobs, 0.2) == ["last_common", "last_rare", "last_rare"]
    assert noise.parts(0.05) == ("walk_rare", "walk_common", "last_rare", "last_common")


def test_splitting_a_shared_turn_by_part_keeps_its_independent_noise():
    # Node "w" shared by two rows, its second token rare: split, each part's coefficients still sum over the rows
    # before squaring, and the parts' noise adds up to the unsplit turn's.
    whole = [("w", [7, 8], [0.25, 0.5], "walk"), ("w", [7, 8], [0.25, 0.5], "walk")]
    split = [("w", [7], [0.25], "walk_common"), ("w", [8], [0.5], "walk_rare")] * 2
    names = noise.parts(0.05)
    out = noise.noise_energies(split, names)
    assert out["walk_common"]["independent"] == pytest.approx(0.5 ** 2)
    assert out["walk_rare"]["independent"] == pytest.approx(1.0 ** 2)
    assert out["last_rare"] == {"independent": 0.0, "coherent": 0.0}
    total = sum(out[p]["independent"] for p in names)
    assert total == pytest.approx(noise.noise_energies(whole)["walk"]["independent"])


def test_a_leafs_environment_tokens_belong_to_no_part():
    # Two turns, each one generated token then the environment's reply (mask 0, log-probability 0): only the
    # generated tokens get a part; the second turn's token is rare.
    from types import SimpleNamespace
    transcript = SimpleNamespace(response_mask=[1, 0, 0, 1, 0], response_logprobs=[-0.1, 0.0, 0.0, -5.0, 0.0])
    leaf = SimpleNamespace(transcript=transcript, meta=SimpleNamespace(turn_spans=[(0, 3), (3, 5)]))
    assert noise.leaf_token_parts(leaf) == [(0, 0, "walk"), (1, 3, "last")]
    assert noise.leaf_token_parts(leaf, 0.05) == [(0, 0, "walk_common"), (1, 3, "last_rare")]


def test_shares_of_a_batch_with_no_noise_are_nan_not_a_crash():
    import numpy as np
    zero = np.zeros((3, 3))
    grams = {"walk": zero, "last": zero, "whole": zero}
    out = noise.compare({"tokens": 1.0, "energies": {}, "grams": grams},
                        {"tokens": 1.0, "energies": {}, "grams": grams}, 3)
    assert np.isnan(out["walk"]["gradient"]["share"]["bpo"])
    assert "share" not in out["whole"]["gradient"]


def test_the_gram_of_a_sum_of_parts_holds_their_cross_terms():
    # Three batches of two parts built to cancel in part: each part's Gram is its own, a sum's is the Gram of the
    # summed draws (not the sum of the parts' Grams), whatever the chunk the products are built in.
    import numpy as np
    rng = np.random.default_rng(0)
    walk = [rng.normal(size=7).astype(np.float32) for _ in range(3)]
    last = [(-0.5 * g + rng.normal(size=7)).astype(np.float32) for g in walk]
    grams = noise.part_grams({"walk": walk, "last": last}, {"whole": ("walk", "last")}, chunk=3)
    stack = {name: np.stack(draws).astype(np.float64) for name, draws in (("walk", walk), ("last", last))}
    whole = stack["walk"] + stack["last"]
    np.testing.assert_allclose(grams["walk"], stack["walk"] @ stack["walk"].T)
    np.testing.assert_allclose(grams["last"], stack["last"] @ stack["last"].T)
    np.testing.assert_allclose(grams["whole"], whole @ whole.T)
    assert not np.allclose(grams["whole"], grams["walk"] + grams["last"])


def test_with_the_rare_split_each_turn_part_is_measured_whole():
    assert noise.part_sums() == {"whole": ("walk", "last")}
    assert noise.part_sums(0.05) == {"whole": ("walk_rare", "walk_common", "last_rare", "last_common"),
                                     "walk": ("walk_rare", "walk_common"), "last": ("last_rare", "last_common")}


def test_a_turn_part_whole_adds_its_halves_independent_noise_and_pools_their_tokens_coherent_noise():
    # Token 7 common in one leaf's walk (+0.5) and rare in another's (-0.5): apart, each half keeps its noise; whole,
    # the one score of token 7 cancels, while the independent scores still add.
    turns = [("a", [7], [0.5], "walk_common"), ("b", [7], [-0.5], "walk_rare"), ("c", [3], [1.0], "last_common")]
    out = noise.split_energies(turns, 0.05)
    assert out["walk_common"] == {"independent": 0.25, "coherent": 0.25}
    assert out["walk_rare"] == {"independent": 0.25, "coherent": 0.25}
    assert out["walk"] == {"independent": 0.5, "coherent": 0.0}
    assert out["last"] == {"independent": 1.0, "coherent": 1.0}
    assert set(noise.split_energies([("a", [7], [0.5], "walk")])) == {"walk", "last"}
