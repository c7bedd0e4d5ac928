"""Per-row tree metadata (one row per leaf) and its conversion into a :class:`~verl_bpo.core.tree.Forest`.

The tree sampler attaches one :class:`LeafMeta` to every leaf it returns (verl's ``AgentLoopOutput.extra_fields``
under :data:`META_KEY`); the trainer hands the list to the ``bpo`` estimator. Everything here is validated with
errors that name the field, the row and the fix, because a silent mismatch would train on wrong credit.

Rewards. A turn's reward is ``turn_rewards[t]``, its sandbox step's reward. Whatever the trainer adds to a row on
top of those (verl's ``algorithm.use_kl_in_reward`` penalty, a reward function's shaping) is the row total minus
Σ ``turn_rewards``; it is credited to the row's last turn, which leads into the row's own leaf node and so is never
shared with another row. GRPO sees the same total, so BPO and the baselines optimise the same return.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from verl_bpo.core.tree import Forest

__all__ = ["META_KEY", "LeafMeta", "LeafRows", "build_leaf_rows", "is_padding_uid"]

META_KEY = "bpo"  # key of the metadata inside AgentLoopOutput.extra_fields
MASS_RTOL = 1e-6


def is_padding_uid(uid: object) -> bool:
    """verl's trainer pads batches with rows whose uid starts with ``pad`` (trainer/ppo/padding_utils.py)."""
    return isinstance(uid, str) and uid.startswith("pad")


@dataclasses.dataclass(frozen=True)
class LeafMeta:
    """Where one leaf row sits in its tree.

    Attributes:
        tree_id: the tree (one per task prompt; the sampler uses verl's ``uid``).
        leaf_id: index of the leaf within its tree, ``0 .. leaves-1``.
        node_path: node ids from the root to the leaf's terminal node; turn ``t`` goes from ``node_path[t]`` to
            ``node_path[t + 1]``. Node ids are unique within a tree and shared by every leaf through that node.
        turn_spans: ``[start, end)`` token positions of each turn's generated tokens in the row's response;
            one per turn, increasing and non-overlapping.
        leaf_mass: ``w = Π 1/K`` over the forks on the path, as the sampler computed it (checked against the tree).
        turn_rewards: reward of each turn's sandbox step; absent = all 0 (then the row's whole reward, e.g. a
            terminal success score, is credited to its last turn).
        failed: the branch's last turn crashed or timed out in the sandbox. That turn earned 0 and, under
            ``bpo.mask_failed_turns`` (default), its tokens carry ``response_mask = 0``: it is never a negative
            sample for what the model said. The leaf stays in the tree with the rewards its earlier turns earned,
            so every mass stays right.
    """

    tree_id: str
    leaf_id: int
    node_path: tuple[int, ...]
    turn_spans: tuple[tuple[int, int], ...]
    leaf_mass: float
    turn_rewards: tuple[float, ...] | None = None
    failed: bool = False

    @property
    def num_turns(self) -> int:
        return len(self.node_path) - 1

    @classmethod
    def from_dict(cls, meta: Mapping[str, Any], row: int = -1) -> LeafMeta:
        where = f"tree metadata of row {row}"
        missing = [f for f in ("tree_id", "leaf_id", "node_path", "turn_spans", "leaf_mass") if f not in meta]
        if missing:
            raise ValueError(f"{where} lacks {missing}; rows must come from the BPO tree agent loop")
        path = tuple(int(v) for v in meta["node_path"])
        spans = tuple((int(s), int(e)) for s, e in meta["turn_spans"])
        rewards = meta.get("turn_rewards")
        rewards = None if rewards is None else tuple(float(r) for r in rewards)
        mass = float(meta["leaf_mass"])
        if len(path) < 2:
            raise ValueError(f"{where}: node_path={list(path)} needs a root and at least one turn")
        if len(spans) != len(path) - 1:
            raise ValueError(f"{where}: {len(spans)} turn_spans for {len(path) - 1} turns; need one span per turn")
        if rewards is not None and len(rewards) != len(spans):
            raise ValueError(f"{where}: {len(rewards)} turn_rewards for {len(spans)} turns; need one per turn")
        if not mass > 0.0:
            raise ValueError(f"{where}: leaf_mass={mass} must be > 0 (the product of 1/K over the forks on the path)")
        return cls(str(meta["tree_id"]), int(meta["leaf_id"]), path, spans, mass, rewards, bool(meta.get("failed")))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for ``extra_fields``."""
        out = dataclasses.asdict(self)
        out["node_path"] = list(self.node_path)
        out["turn_spans"] = [list(s) for s in self.turn_spans]
        out["turn_rewards"] = None if self.turn_rewards is None else list(self.turn_rewards)
        return out


@dataclasses.dataclass(frozen=True)
class LeafRows:
    """A forest built from leaf rows, with the map from each row's turns to forest nodes.

    Attributes:
        forest: the trees of the batch.
        rows: ``(n_rows,)`` indices of the batch rows that are leaves (padding rows are left out).
        leaf_node: ``(n_rows,)`` forest node at the end of each of those rows.
        tree_of_row: ``(n_rows,)`` index of each of those rows' tree among the batch's trees.
        turn_row, turn_node, turn_start, turn_end: one entry per (row, turn): batch row, the forest node the turn
            leads into, and its token span.
    """

    forest: Forest
    rows: np.ndarray
    leaf_node: np.ndarray
    tree_of_row: np.ndarray
    turn_row: np.ndarray
    turn_node: np.ndarray
    turn_start: np.ndarray
    turn_end: np.ndarray

    @property
    def num_trees(self) -> int:
        return int(self.tree_of_row.max(initial=-1)) + 1


def _leaf_rows_to_keep(metas: Sequence[LeafMeta | None], active: np.ndarray) -> dict[tuple[str, int], int]:
    """For each leaf key, the batch row that carries it; independent of row order.

    A key on two active rows is an error. verl's padding copies a row with a zero mask and its metadata, so an
    inactive row whose key also sits on an active row is that copy. When every row of a key is inactive (a dead
    tree's empty leaves and their copies) the rows are identical and the first one stands for the key.
    """
    keep: dict[tuple[str, int], int] = {}
    for i, meta in enumerate(metas):
        if meta is None:
            continue
        key = (meta.tree_id, meta.leaf_id)
        j = keep.get(key)
        if j is None or (active[i] and not active[j]):
            keep[key] = i
        elif active[i] and active[j]:
            raise ValueError(f"rows {j} and {i}: leaf {meta.leaf_id} of tree {meta.tree_id!r} appears twice in "
                             "the batch")
    return keep


def build_leaf_rows(
    metas: Sequence[Mapping[str, Any] | LeafMeta | None],
    uids: Sequence[object] | None,
    row_totals: np.ndarray,
    response_lengths: np.ndarray,
    active: np.ndarray,
) -> LeafRows:
    """Validate the metadata of a batch of leaf rows and build their forest.

    Args:
        metas: per batch row, the leaf metadata (dict or LeafMeta); ``None`` only for padding rows.
        uids: per batch row, verl's prompt uid (``index``); rows of one tree must share it. ``None`` skips the check.
        row_totals: ``(bs,)`` total reward of each row (sum of ``token_level_rewards``); what exceeds the row's
            ``turn_rewards`` is credited to its last turn (module docstring).
        response_lengths: ``(bs,)`` length of the response tensor each span must fit in.
        active: ``(bs,)`` bool, False for rows with an all-zero response mask (padding copies carry copied metadata).
    """
    parsed: list[LeafMeta | None] = []
    for i, raw in enumerate(metas):
        uid = None if uids is None else uids[i]
        if is_padding_uid(uid):
            parsed.append(None)
            continue
        if raw is None:
            raise ValueError(
                f"row {i} (uid {uid!r}) has no tree metadata; every row must come from the BPO tree agent loop "
                "(algorithm.adv_estimator=bpo runs it)"
            )
        parsed.append(raw if isinstance(raw, LeafMeta) else LeafMeta.from_dict(raw, row=i))
    keep = set(_leaf_rows_to_keep(parsed, active).values())

    parent: list[int] = []
    reward: list[float] = []
    node_index: dict[tuple[str, int], int] = {}
    tree_uid: dict[str, object] = {}
    uid_tree: dict[object, str] = {}
    tree_index: dict[str, int] = {}
    rows, leaf_node, declared_mass, tree_of_row = [], [], [], []
    turn_row, turn_node, turn_start, turn_end = [], [], [], []

    for i, meta in enumerate(parsed):
        if meta is None or i not in keep:
            continue
        uid = None if uids is None else uids[i]
        if uid is not None and tree_uid.setdefault(meta.tree_id, uid) != uid:
            raise ValueError(
                f"row {i}: tree_id {meta.tree_id!r} has uid {uid!r} but other rows of that tree have uid "
                f"{tree_uid[meta.tree_id]!r}; one tree must be one uid group"
            )
        if uid is not None and uid_tree.setdefault(uid, meta.tree_id) != meta.tree_id:
            raise ValueError(
                f"row {i}: uid {uid!r} carries tree {meta.tree_id!r} and tree {uid_tree[uid]!r}; the sessions of "
                "one uid must return the leaves of one tree"
            )
        prev_end = 0
        for t, (s, e) in enumerate(meta.turn_spans):
            if not (prev_end <= s < e <= response_lengths[i]):
                raise ValueError(
                    f"row {i}: turn_spans[{t}]={[s, e]} is outside the response (length {response_lengths[i]}) or "
                    f"overlaps the previous turn (ends at {prev_end}); spans are [start, end) token offsets"
                )
            prev_end = e
        rewards = list(meta.turn_rewards or (0.0,) * meta.num_turns)
        rewards[-1] += float(row_totals[i]) - sum(meta.turn_rewards or ())  # what the trainer added to the row
        path_nodes = []
        for t, node_id in enumerate(meta.node_path):
            node_key = (meta.tree_id, node_id)
            expected_parent = path_nodes[-1] if path_nodes else -1
            idx = node_index.get(node_key)
            if idx is None:
                idx = node_index[node_key] = len(parent)
                parent.append(expected_parent)
                reward.append(0.0 if t == 0 else rewards[t - 1])
            elif parent[idx] != expected_parent:
                raise ValueError(
                    f"row {i}: node {node_id} of tree {meta.tree_id!r} has two different parents in the batch; "
                    "node ids must be unique within a tree"
                )
            elif t > 0 and not math.isclose(reward[idx], rewards[t - 1], rel_tol=1e-6, abs_tol=1e-8):
                raise ValueError(
                    f"row {i}: turn into node {node_id} of tree {meta.tree_id!r} has reward {rewards[t - 1]} here "
                    f"but {reward[idx]} in another leaf; a shared turn must carry one reward"
                )
            path_nodes.append(idx)
        rows.append(i)
        leaf_node.append(path_nodes[-1])
        declared_mass.append(meta.leaf_mass)
        tree_of_row.append(tree_index.setdefault(meta.tree_id, len(tree_index)))
        turn_row.extend([i] * meta.num_turns)
        turn_node.extend(path_nodes[1:])
        turn_start.extend(s for s, _ in meta.turn_spans)
        turn_end.extend(e for _, e in meta.turn_spans)

    forest = Forest(np.array(parent, dtype=np.int64), np.array(reward))
    leaf_node_arr = np.array(leaf_node, dtype=np.int64)
    if np.any(forest.num_children[leaf_node_arr] > 0):
        bad = int(np.flatnonzero(forest.num_children[leaf_node_arr] > 0)[0])
        raise ValueError(f"row {rows[bad]}: its last node has children in another row; a leaf must end its path")
    if len(set(leaf_node)) != len(leaf_node):
        raise ValueError("two rows end at the same node; every leaf needs its own terminal node id")
    _check_masses(forest, leaf_node_arr, np.array(declared_mass), rows)
    as_int = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return LeafRows(forest, as_int(rows), leaf_node_arr, as_int(tree_of_row), as_int(turn_row), as_int(turn_node),
                    as_int(turn_start), as_int(turn_end))


def _check_masses(forest: Forest, leaf_node: np.ndarray, declared: np.ndarray, rows: list[int]) -> None:
    """The sampler's leaf masses must equal Π 1/K of the tree the rows describe; else a leaf is missing."""
    got = forest.masses()[leaf_node]
    bad = np.flatnonzero(~np.isclose(got, declared, rtol=MASS_RTOL, atol=0.0))
    if bad.size:
        j = int(bad[0])
        raise ValueError(
            f"row {rows[j]}: leaf_mass={declared[j]} but the forks in this batch give {got[j]}; a leaf of that tree "
            "is missing from the batch (all leaves of a tree must be trained together)"
        )
