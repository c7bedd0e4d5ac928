"""The packed layout of a tree (verl_bpo/core/packing.py): every leaf token is a copy of one packed token that has
the same position and sees exactly the leaf row's context under the tree attention rule (bridges included), and the
packed row holds fewer tokens than the leaf rows."""

from __future__ import annotations

import numpy as np
import pytest

from verl_bpo.core.leaf_meta import LeafMeta
from verl_bpo.core.packing import LeafTokens, PackedTree, pack_tree


def leaf(tree_id, leaf_id, prompt, turns, pre=(), nodes=None, mass=1.0):
    """A leaf row from its turns (each a token list: generated tokens then observation tokens, split at ``|``)."""
    response, spans = list(pre), []
    for turn in turns:
        gen, obs = (turn.split("|") + [""])[:2]
        start = len(response)
        response += [ord(c) for c in gen]
        spans.append((start, len(response)))
        response += [ord(c) for c in obs]
    path = nodes if nodes is not None else [0, *range(1, len(turns) + 1)]
    meta = LeafMeta(tree_id, leaf_id, tuple(path), tuple(spans), mass)
    return LeafTokens(np.array(prompt), np.array(response, dtype=np.int64), meta)


def visible(tree: PackedTree, query: int) -> np.ndarray:
    """Positions ``query`` attends under the tree rule (tree_attention.py): keys of strict ancestor segments, and
    keys of its own segment up to itself."""
    seg = tree.segment[query]
    ancestors = set()
    s = tree.parent[seg]
    while s >= 0:
        ancestors.add(int(s))
        s = tree.parent[s]
    j = np.arange(len(tree.input_ids))
    own = (tree.segment == seg) & (j <= query)
    return j[tree.is_key & (np.isin(tree.segment, list(ancestors)) | own)]


def check_exact(tree: PackedTree, leaves: list[LeafTokens]) -> None:
    """Each leaf token: same id and path position as its packed copy, and the packed position that predicts it
    (the one before it) sees exactly the leaf row's tokens before it, at their positions."""
    p = tree.prompt_len
    covered = np.zeros(len(tree.copy_leaf), bool)
    for i, lf in enumerate(leaves):
        full = np.concatenate([lf.prompt, lf.response])
        sel = tree.copy_leaf == i
        src, dst = tree.copy_src[sel], tree.copy_dst[sel]
        assert sorted(src.tolist()) == list(range(len(lf.response))), "every leaf token has exactly one copy"
        covered |= sel
        for s, d in zip(src, dst):
            assert tree.input_ids[p + d] == lf.response[s]
            assert tree.position_ids[p + d] == p + s
            ctx = visible(tree, p + d - 1)
            order = np.argsort(tree.position_ids[ctx])
            assert tree.position_ids[ctx][order].tolist() == list(range(p + s)), (i, s)
            assert tree.input_ids[ctx][order].tolist() == full[:p + s].tolist(), (i, s)
    assert covered.all()
    assert np.all(tree.parent[1:] < np.arange(1, len(tree.parent))), "parents come before children"


PROMPT = [1, 2, 3]


def test_forks_at_several_depths_with_observations_and_early_ends():
    leaves = [
        leaf("t", 0, PROMPT, ["ab|xy", "cd|zz", "e"], nodes=[0, 1, 2, 3]),
        leaf("t", 1, PROMPT, ["ab|xy", "cd|zz", "f|q"], nodes=[0, 1, 2, 4]),
        leaf("t", 2, PROMPT, ["ab|xy", "gh|w"], nodes=[0, 1, 5]),  # ended early
        leaf("t", 3, PROMPT, ["ij|uv", "k"], nodes=[0, 6, 7]),
        leaf("t", 4, PROMPT, ["ij|uv", "lm|n"], nodes=[0, 6, 8]),
    ]
    tree = pack_tree(leaves)
    check_exact(tree, leaves)
    total = sum(len(lf.prompt) + len(lf.response) for lf in leaves)
    assert len(tree.input_ids) == 29 and total == 53  # 25 unique tokens + 4 bridges, against 53
    # bridges: one before each later child (under node 1: 1, under node 2: 1, under the root: 1, under node 6: 1)
    assert int(tree.is_bridge.sum()) == 4


def test_tokens_before_the_first_turn_are_shared():
    leaves = [leaf("t", i, PROMPT, [g], pre=[9, 9]) for i, g in enumerate(["a", "b", "c"])]
    leaves = [LeafTokens(lf.prompt, lf.response, LeafMeta("t", i, (0, i + 1), lf.meta.turn_spans, 1 / 3))
              for i, lf in enumerate(leaves)]
    tree = pack_tree(leaves)
    check_exact(tree, leaves)
    assert tree.response_len == 2 + 3 + 2  # shared [9, 9], three turns, two bridges


def test_a_node_whose_tokens_differ_between_leaves_is_not_merged():
    # a truncated copy of node 1 (row cut inside its observation) must not share it, nor what follows
    full = leaf("t", 0, PROMPT, ["ab|xyz", "c"], nodes=[0, 1, 2])
    cut = LeafTokens(np.array(PROMPT), full.response[:4], LeafMeta("t", 1, (0, 1), ((0, 2),), 0.5))
    tree = pack_tree([full, cut])
    check_exact(tree, [full, cut])


def test_values_move_between_layouts():
    leaves = [leaf("t", i, PROMPT, ["ab|x", t]) for i, t in enumerate(["cd", "ef"])]
    leaves = [LeafTokens(lf.prompt, lf.response, LeafMeta("t", i, (0, 1, 2 + i), lf.meta.turn_spans, 0.5))
              for i, lf in enumerate(leaves)]
    tree = pack_tree(leaves)
    adv = [np.arange(len(lf.response), dtype=float) + 1 for lf in leaves]
    summed = tree.sum_copies(adv)
    # the shared first turn ("ab" and "x") carries both copies' values
    assert summed[:3].tolist() == [2.0, 4.0, 6.0]
    packed = np.arange(tree.response_len, dtype=float)
    back = tree.to_leaves(packed, [len(lf.response) for lf in leaves])
    for i, b in enumerate(back):
        sel = tree.copy_leaf == i
        assert np.array_equal(b[tree.copy_src[sel]], packed[tree.copy_dst[sel]])
    assert np.array_equal(tree.any_copy(adv)[tree.is_bridge], np.zeros(int(tree.is_bridge.sum())))


@pytest.mark.parametrize("seed", range(5))
def test_random_trees(seed):
    rng = np.random.default_rng(seed)
    leaves, next_node = [], [1]

    def grow(path, prefix_turns, depth):
        width = int(rng.integers(1, 4)) if depth < 4 else 1
        if depth >= 4 or (depth > 0 and rng.random() < 0.3):
            leaves.append(leaf("t", len(leaves), PROMPT, prefix_turns, nodes=path))
            return
        for _ in range(width):
            node = next_node[0]
            next_node[0] += 1
            gen = "".join(chr(97 + int(c)) for c in rng.integers(0, 5, size=int(rng.integers(1, 4))))
            obs = "".join(chr(65 + int(c)) for c in rng.integers(0, 5, size=int(rng.integers(0, 3))))
            grow([*path, node], [*prefix_turns, f"{gen}|{obs}"], depth + 1)

    grow([0], [], 0)
    tree = pack_tree(leaves)
    check_exact(tree, leaves)


def test_rows_of_one_tree_share_their_prompt():
    a = leaf("t", 0, PROMPT, ["a"])
    b = leaf("t", 1, [7, 7], ["b"])
    with pytest.raises(ValueError, match="another prompt"):
        pack_tree([a, b])
