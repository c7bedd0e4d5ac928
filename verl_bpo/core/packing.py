"""The packed layout of a tree: each unique token once, so the trainer forwards and back-propagates it once.

verl trains one row per leaf, so a token above a fork is trained once per leaf below it. BPO's gradient is a sum
over segments (``(1/B) Σ_trees Σ_e W_e A_e ∇log π(seg_e)``), and verl's PPO-clip token loss is positively
homogeneous in the advantage (``f(r, c·a) = c·f(r, a)`` for c > 0). Every copy of a segment carries the same ratio
(its context, the ancestor segments, is the same) and an advantage of the same sign (``s · w_leaf · A_e``,
``w_leaf > 0``), so one copy carrying the **sum** of the copies' advantages gives exactly the leaf layout's loss
and gradient (``../shared/research/packed_training.md``).

A packed tree is one ordinary verl row: the tree's prompt, then every unique response token in depth-first order.

* **Segments.** A leaf row's response splits at its turns' starts; the piece from turn t's first token up to
  turn t+1's is the segment of the node turn t leads into (its generated tokens and the observation after them),
  and the tokens before the first turn form one more segment under the prompt. Two leaves share a segment when they
  share its parent segment, its node and its tokens: a node whose tokens differ between leaves (a truncated row)
  becomes two segments, so merging never joins tokens whose contexts differ.
* **Positions.** Each token's position along its own root-to-leaf path: siblings reuse their parent's next
  positions, so a token sees the same rotary positions as in its leaf row.
* **Attention.** A token attends its own segment's earlier tokens and every key of its ancestor segments,
  never a sibling (:mod:`verl_bpo.integration.tree_attention`).
* **Bridges.** verl reads the log-prob of response token k from the logits at position k - 1. A segment that does
  not follow its parent's last token directly (every child but the first, in depth-first order) is preceded by a
  *bridge*: a copy of the parent's last token, with its position, in a segment of its own under the parent, that
  attends what the original attends and is nobody's key. Its logits are the original's, so the segment's first
  token gets the right log-prob; the bridge itself has response mask 0 and no advantage (one token per fork).
* **Copies.** Every response token of every leaf row is a copy of one packed response token
  (``copy_leaf``, ``copy_src`` → ``copy_dst``): leaf values gather from the packed ones (old and reference
  log-probs), packed values sum the copies (advantages) or take any copy (rollout log-probs, which are equal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from verl_bpo.core.leaf_meta import LeafMeta

__all__ = ["LeafTokens", "PackedTree", "pack_tree"]

_BEFORE_FIRST_TURN = -1  # the node key of the tokens before a row's first turn


@dataclasses.dataclass(frozen=True)
class LeafTokens:
    """One leaf row of a tree: its prompt and response token ids and where its turns start."""

    prompt: np.ndarray
    response: np.ndarray
    meta: LeafMeta


@dataclasses.dataclass(frozen=True)
class PackedTree:
    """One tree as one row of unique tokens (module docstring).

    Attributes:
        prompt_len: the tree's prompt tokens at the start of ``input_ids``.
        input_ids: ``(L,)`` the prompt, then each unique response token once in depth-first order, with bridges.
        position_ids: ``(L,)`` each token's position along its own root-to-leaf path.
        segment: ``(L,)`` each token's segment; segment 0 is the prompt, parents come before their children.
        parent: ``(S,)`` each segment's parent segment (-1 for the prompt).
        is_key: ``(L,)`` False on bridges (attended by nobody), True elsewhere.
        copy_leaf, copy_src, copy_dst: ``(C,)`` one entry per response token of every leaf row: the leaf (its index
            in the list given to :func:`pack_tree`), its position in that leaf's response, and the packed
            response position (``input_ids[prompt_len + copy_dst]``) it is a copy of.
    """

    prompt_len: int
    input_ids: np.ndarray
    position_ids: np.ndarray
    segment: np.ndarray
    parent: np.ndarray
    is_key: np.ndarray
    copy_leaf: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def is_bridge(self) -> np.ndarray:
        """``(response_len,)`` True on the response's bridge tokens."""
        return ~self.is_key[self.prompt_len:]

    def sum_copies(self, leaf_values: Sequence[np.ndarray]) -> np.ndarray:
        """``(response_len,)`` each packed response token's sum over its copies of per-leaf response values."""
        out = np.zeros(self.response_len, dtype=np.result_type(*leaf_values, np.float64))
        values = np.array([leaf_values[leaf][src] for leaf, src in zip(self.copy_leaf, self.copy_src)])
        np.add.at(out, self.copy_dst, values)
        return out

    def any_copy(self, leaf_values: Sequence[np.ndarray], fill: float = 0) -> np.ndarray:
        """``(response_len,)`` one copy's value per packed response token (``fill`` on bridges): for values every
        copy shares (rollout log-probs); for a 0/1 mask use :meth:`sum_copies` and ``> 0``."""
        out = np.full(self.response_len, fill, dtype=np.result_type(*leaf_values))
        out[self.copy_dst] = [leaf_values[leaf][src] for leaf, src in zip(self.copy_leaf, self.copy_src)]
        return out

    def to_leaves(self, packed_values: np.ndarray, response_lens: Sequence[int]) -> list[np.ndarray]:
        """Per leaf, its response's values read from the packed response values (old and reference log-probs)."""
        out = [np.zeros(n, dtype=packed_values.dtype) for n in response_lens]
        for leaf, src, dst in zip(self.copy_leaf, self.copy_src, self.copy_dst):
            out[leaf][src] = packed_values[dst]
        return out


@dataclasses.dataclass
class _Segment:
    parent: int
    tokens: np.ndarray
    children: list[int] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (leaf, response start)


def _pieces(leaf: LeafTokens) -> list[tuple[int, int, int]]:
    """``(node key, start, end)`` of a leaf response's segments: before the first turn, then one per turn."""
    starts = [s for s, _ in leaf.meta.turn_spans]
    bounds = [0, *starts, len(leaf.response)]
    keys = [_BEFORE_FIRST_TURN, *leaf.meta.node_path[1:]]
    return [(k, s, e) for k, s, e in zip(keys, bounds[:-1], bounds[1:]) if e > s]


def pack_tree(leaves: Sequence[LeafTokens]) -> PackedTree:
    """Pack the leaf rows of one tree (module docstring). The rows must share their prompt."""
    if not leaves:
        raise ValueError("a tree needs at least one leaf row to pack")
    prompt = np.asarray(leaves[0].prompt, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("a packed tree needs a prompt of at least one token")
    segments = [_Segment(-1, prompt)]
    index: dict[tuple[int, int, bytes], int] = {}
    for i, leaf in enumerate(leaves):
        if not np.array_equal(np.asarray(leaf.prompt), prompt):
            raise ValueError(f"leaf row {i} of tree {leaf.meta.tree_id!r} has another prompt than leaf row 0; the "
                             "rows of one tree share their prompt")
        response = np.asarray(leaf.response, dtype=np.int64)
        current = 0
        for node, start, end in _pieces(leaf):
            tokens = response[start:end]
            key = (current, node, tokens.tobytes())
            seg = index.get(key)
            if seg is None:
                seg = index[key] = len(segments)
                segments.append(_Segment(current, tokens))
                segments[current].children.append(seg)
            segments[seg].copies.append((i, start))
            current = seg
    return _emit(segments)


def _emit(segments: list[_Segment]) -> PackedTree:
    """Lay the segments out depth-first, renumbered in emission order, with a bridge before each later child."""
    prompt = segments[0].tokens
    ids, pos = [prompt], [np.arange(len(prompt))]
    seg_of, key = [np.zeros(len(prompt), np.int64)], [np.ones(len(prompt), bool)]
    parent = [-1]
    emitted = {0: 0}  # input segment -> packed segment id
    last_pos = {0: len(prompt) - 1}  # packed position of each emitted segment's last token
    path_len = {0: len(prompt)}  # its path length at its last token
    length = len(prompt)
    copy_leaf, copy_src, copy_dst = [], [], []
    stack = list(reversed(segments[0].children))
    while stack:
        s = stack.pop()
        seg, up = segments[s], segments[s].parent
        if last_pos[up] != length - 1:  # not right after its parent's last token: bridge
            ids.append(segments[up].tokens[-1:])
            pos.append(np.array([path_len[up] - 1]))
            seg_of.append(np.array([len(parent)]))
            key.append(np.zeros(1, bool))
            parent.append(emitted[up])
            length += 1
        n = len(seg.tokens)
        emitted[s] = len(parent)
        parent.append(emitted[up])
        ids.append(seg.tokens)
        pos.append(path_len[up] + np.arange(n))
        seg_of.append(np.full(n, emitted[s]))
        key.append(np.ones(n, bool))
        for leaf, start in seg.copies:
            copy_leaf.append(np.full(n, leaf))
            copy_src.append(start + np.arange(n))
            copy_dst.append(length - len(prompt) + np.arange(n))
        length += n
        last_pos[s], path_len[s] = length - 1, path_len[up] + n
        stack.extend(reversed(seg.children))
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    return PackedTree(
        prompt_len=len(prompt), input_ids=cat(ids, np.int64), position_ids=cat(pos, np.int64),
        segment=cat(seg_of, np.int64), parent=np.array(parent, dtype=np.int64), is_key=cat(key, bool),
        copy_leaf=cat(copy_leaf, np.int64), copy_src=cat(copy_src, np.int64), copy_dst=cat(copy_dst, np.int64))

