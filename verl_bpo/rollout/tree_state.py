"""A tree as it grows (its branches and node ids) and what it becomes (its leaves).

A *branch* is one live path: the sandbox it acts in, its token transcript, the nodes it passed, and the rewards
its turns earned. A fork copies a branch (a restored sandbox, a copied transcript); every branch, original
included, then samples a fresh turn. A finished branch is a *leaf*: its transcript plus the
:class:`~verl_bpo.core.leaf_meta.LeafMeta` that places it in the tree for the estimator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from typing import Any

from sandbox_adapters.base import Sandbox, Snapshot
from verl_bpo.core.fork_policy import NodeView
from verl_bpo.core.leaf_meta import LeafMeta
from verl_bpo.core.profile import TreeRecord
from verl_bpo.rollout.protocols import Transcript

__all__ = ["Anchor", "Branch", "Leaf", "TreeResult", "TreeState", "derive_seed"]


def derive_seed(*parts: int | str) -> int:
    """A 31-bit seed that is a pure function of ``parts`` (e.g. a branch's seed, what it is for and its depth).

    Every random draw of a branch (its turns' sampling seeds, its sandboxes' re-seeding, its children's seeds) is
    derived from the branch's own seed this way rather than drawn from one generator shared by the tree: branches
    run concurrently, so the order in which they would draw from a shared one depends on sandbox and server
    latencies, and so would the tree."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


class Anchor:
    """A snapshot kept so that a failed sandbox step can be retried from the state before it.

    Shared by the branches that can be rebuilt from it (the siblings of a fork) and closed when the last of them
    lets go, so no snapshot outlives the branches that need it.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.holders = 0

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.snapshot.close()


@dataclasses.dataclass
class Branch:
    """One live path of the tree.

    Attributes:
        node: the decision node the branch stands on (0 = the root).
        sandbox: the sandbox it acts in; ``None`` once the branch has ended and closed it.
        transcript: its token stream.
        node_path: node ids from the root to ``node``.
        turn_rewards: reward of each turn's sandbox step (a failed step earns 0).
        mass: ω of ``node``: Π 1/K over the forks above it.
        depth: turns taken.
        seed: the branch's own random stream: its draws derive from it and its depth (:func:`derive_seed`), and
            each child of a fork gets its own, derived from its parent's.
        forks: forks on the path, the root fork excluded.
        since_fork: turns since the last fork on the path (the root counts as one).
        last_turn_surprisal: mean −log π of the turn that led to ``node``.
        pending: the kept turn drawn before the fork decision (the biased ``bpo.ablation.kept_turn_surprisal``
            only).
        budget: the amount the branch's subtree may still spend, in the unit of the plan's
            :class:`~verl_bpo.core.fork_policy.TreeBudget` (set by the sampler's one budget helper).
        born: when the branch was created (``time.perf_counter``), for the tree's wall-time breakdown.
        done, failed, truncated, won: how the branch ended (``failed``: its last step crashed or hung).
        tampered: the sandbox reported ``info["grading_tampered"]`` on the final step (its grader saw the tests'
            results forged).
        error: a short description of the failure, if any.
        anchor: the snapshot the branch's sandbox can be rebuilt from after a failed step (``bpo.step_retries``):
            taken before each step where snapshots are cheap, else its last fork's.
        anchor_seed: the seed the branch's sandbox was restored from ``anchor`` with (``None``: the snapshot was
            taken of the branch's own sandbox).
        replay: the action texts stepped since ``anchor``, each with the seed its sandbox was re-seeded with just
            before it (``None``: not re-seeded); with ``anchor`` and ``anchor_seed`` they rebuild the sandbox.
    """

    node: int
    sandbox: Sandbox | None
    transcript: Transcript
    node_path: list[int]
    turn_rewards: list[float]
    mass: float
    depth: int = 0
    seed: int = 0
    forks: int = 0
    since_fork: int = 0
    last_turn_surprisal: float | None = None
    pending: tuple[list[int], list[float]] | None = None
    budget: float = 0.0
    born: float = dataclasses.field(default_factory=time.perf_counter)
    done: bool = False
    failed: bool = False
    truncated: bool = False
    won: bool = False
    tampered: bool = False
    error: str | None = None
    anchor: Anchor | None = None
    anchor_seed: int | None = None
    replay: list[tuple[int | None, str]] = dataclasses.field(default_factory=list)

    def view(self, max_turns: int) -> NodeView:
        """The frozen view of the branch's node: all a fork decision may read."""
        return NodeView(node_id=self.node, depth=self.depth, history=tuple(self.transcript.token_ids),
                        parent_turn_surprisal=self.last_turn_surprisal, forks_on_path=self.forks,
                        turns_since_fork=self.since_fork, horizon_left=max_turns - self.depth, budget=self.budget,
                        mass=self.mass)

    def copy_into(self, sandbox: Sandbox, seed: int) -> Branch:
        """A sibling at the same node: its own sandbox, transcript and ``seed``, the same history (no anchor yet)."""
        return dataclasses.replace(self, sandbox=sandbox, seed=seed, transcript=self.transcript.copy(),
                                   node_path=list(self.node_path), turn_rewards=list(self.turn_rewards), pending=None,
                                   born=time.perf_counter(), anchor=None, anchor_seed=None, replay=[])

    def hold(self, anchor: Anchor, seed: int | None = None) -> None:
        """Rebuild from ``anchor`` from now on (the branch's sandbox was restored from it with ``seed``, or is the
        sandbox it was taken of); lets go of the previous anchor."""
        anchor.holders += 1
        self.let_go()
        self.anchor, self.anchor_seed, self.replay = anchor, seed, []

    def let_go(self) -> None:
        """Release the anchor (its snapshot closes when no other branch holds it)."""
        if self.anchor is not None:
            anchor, self.anchor = self.anchor, None
            anchor.release()


@dataclasses.dataclass
class Leaf:
    """One finished path: its tokens and its place in the tree.

    Attributes:
        transcript: prompt + response tokens, masks and rollout log-probs (a masked failed turn has mask 0).
        meta: the tree metadata the estimator consumes.
        reward: the leaf return (undiscounted sum of its turn rewards; a failed turn earns 0).
        failed: the sandbox crashed, timed out or failed to start on this path.
        truncated: the path hit ``bpo.max_turns`` or the response budget before the episode ended.
        won: the sandbox reported ``info["won"]`` on the final step.
        error: a short description of the failure, if any.
        tampered: the sandbox reported ``info["grading_tampered"]`` on the final step.
    """

    transcript: Transcript
    meta: LeafMeta
    reward: float
    failed: bool = False
    truncated: bool = False
    won: bool = False
    error: str | None = None
    tampered: bool = False

    @property
    def mass(self) -> float:
        return self.meta.leaf_mass


@dataclasses.dataclass
class TreeResult:
    """The leaves of one tree, its metrics (flat ``bpo/...`` names, ready for verl's logger), the model-version
    range of its generations (``min_global_steps``/``max_global_steps`` from verl's server outputs; verl's trainer
    reads them from every row for off-policy accounting), and its record for the fork policy."""

    leaves: list[Leaf]
    metrics: dict[str, float]
    weight_versions: dict[str, int] = dataclasses.field(default_factory=dict)
    record: TreeRecord | None = None  # what the tree teaches the run's fork policy; None for a tree that never started


class TreeState:
    """The branches of one growing tree, its node ids, and its generation counters."""

    def __init__(self, tree_id: str) -> None:
        self.tree_id = tree_id
        self.branches: list[Branch] = []
        self.next_node = 1
        self.forks = 0
        self.step_retries = 0  # failed sandbox steps retried on a rebuilt sandbox (bpo.step_retries)
        self.generated_tokens = 0
        self.weight_versions: dict[str, int] = {}
        self.generate_s = 0.0  # seconds the tree's branches spent waiting for generations, summed over branches
        self.branch_s = 0.0  # seconds the tree's branches were alive, summed over branches
        self.wall_s = 0.0  # the tree's wall time
        self.turn_tokens: dict[int, float] = {}  # per node: the tokens of the turn into it
        self.turn_uncertainty: dict[int, float] = {}  # per node: mean over its turn's tokens of 1 − p(token)

    def new_node(self) -> int:
        node, self.next_node = self.next_node, self.next_node + 1
        return node

    def add_turn(self, node: int, token_ids: list[int], log_probs: list[float]) -> None:
        """The generated turn that leads into ``node``: what it cost and how uncertain it was."""
        self.generated_tokens += len(token_ids)
        self.turn_tokens[node] = float(len(token_ids))
        self.turn_uncertainty[node] = (sum(1.0 - math.exp(lp) for lp in log_probs) / len(log_probs)
                                       if log_probs else 0.0)

    def record(self, task_key: str | None = None) -> TreeRecord:
        """What the finished tree tells the fork policy (the plan completes it: ``ForkPolicy.finish_tree``)."""
        return TreeRecord([tuple(b.node_path) for b in self.branches],
                          [float(sum(b.turn_rewards)) for b in self.branches], [b.mass for b in self.branches],
                          dict(self.turn_uncertainty), dict(self.turn_tokens), task_key=task_key)

    @property
    def turns(self) -> int:
        """Distinct turns generated (one sandbox step each): every node but the root."""
        return self.next_node - 1

    def active(self) -> list[Branch]:
        return [b for b in self.branches if not b.done]

    def open_sandboxes(self) -> list[Branch]:
        return [b for b in self.branches if b.sandbox is not None]

    def track_versions(self, output: Any) -> None:
        """The weight-version range of the generations (verl's server outputs carry it in ``extra_fields``)."""
        extra = getattr(output, "extra_fields", None) or {}
        for key, pick in (("min_global_steps", min), ("max_global_steps", max)):
            if extra.get(key) is not None:
                value = int(extra[key])
                self.weight_versions[key] = pick(self.weight_versions.get(key, value), value)

    def leaves(self, response_length: int, mask_failed_turns: bool) -> list[Leaf]:
        """Every branch as a leaf, in creation order; under ``mask_failed_turns`` the failed turn gets mask 0."""
        leaves = []
        for leaf_id, b in enumerate(self.branches):
            transcript, spans = b.transcript, b.transcript.turn_spans(response_length)
            if b.failed and mask_failed_turns and spans:
                start, end = spans[-1]
                transcript.response_mask[start:end] = [0] * (end - start)
            meta = LeafMeta(self.tree_id, leaf_id, tuple(b.node_path), tuple(spans), b.mass,
                            tuple(b.turn_rewards), b.failed)
            leaves.append(Leaf(transcript, meta, float(sum(b.turn_rewards)), b.failed, b.truncated, b.won, b.error,
                               b.tampered))
        return leaves
