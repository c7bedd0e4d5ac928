"""TreeSampler: grows one BPO tree for one task, against a Sandbox and an LLM client.

The worker's :class:`~verl_bpo.core.fork_policy.ForkPolicy` gives the tree its
:class:`~verl_bpo.core.fork_policy.Plan`, and the sampler talks to the plan only through that protocol. The root
holds the tree's whole budget (:class:`~verl_bpo.core.fork_policy.TreeBudget`: leaves, turns or tokens) and is a
fork of K0 (K0 = N with no later fork is *flat mode*: N independent rollouts through the same code, the GRPO/RLOO
baseline). Then every branch, at each node it reaches:

  1. **decides** — it takes its share of what ended branches left unspent; the node is read from a frozen view of
     its own history and amount (and scored, for plans that use a fork score), and the plan gives it a width; a
     node of width K ≥ 2 is forked: its sandbox is snapshotted once, K − 1 fresh sandboxes are restored from it
     (each re-seeded), the transcript is copied, and the node's amount is split among the K branches;
  2. **acts** — the branch (the original included) samples a fresh turn, spends its cost, and steps its sandbox.
     When its episode ends, what it did not spend goes back to the budget's pool.

Each of these budget events reaches the plan's budget through one helper, :meth:`TreeSampler._tell`, the only
place a branch's amount changes.

Branches run concurrently at their own pace (generation and sandbox steps of different branches overlap), except
where a plan needs the whole wave or the run asks for reproducible trees: the fixed rule's ``topB_wave`` selector,
which ranks the candidates of a whole wave, and every forking tree with ``seeded_turns`` grow in waves (the live
branches take one turn each, then all decide in the tree's branch order).

When the tree is done the policy learns from it (the profile of a learned allocation), unless the caller teaches it
(``policy_learns=False``).

Randomness is per branch: each branch carries its own seed (the root's from the tree's, each fork's children's
from their parent's), and its sandboxes' re-seeding (and, with ``seeded_turns``, its turns' sampling seeds) derive
from it and its depth, never from one generator that concurrent branches draw from in whatever order their sandboxes
and the server answer. With ``seeded_turns`` on an engine that honors per-request seeds, a tree is then the same
whatever the latencies: a flat group by its seeds alone (up to how its nodes are numbered), and a forking tree
because it grows in waves, since branches deciding at their own pace would hand the budget's pool, the plan's
rounding draws and the leaf cap to whichever branch's sandbox answered first.

One request id per tree gives the LLM server sticky routing, so siblings hit the same prefix cache. A sandbox step
that crashes or hangs past ``bpo.step_timeout_s`` is retried (``bpo.step_retries`` times) on a fresh sandbox rebuilt
at the state before it, re-seeded, with the same action text, so a transient fault leaves the path distributed as
it would have been without it; a step that still fails ends its own leaf, never the tree. A sandbox that never
starts (after a retry) turns the tree into N empty failed leaves, so verl's uid group stays whole. Every sandbox
and every snapshot kept for retries is closed when its branch ends, and all of them if the tree itself fails.

The sampler is independent of verl: tokenization goes through a :class:`~verl_bpo.rollout.protocols.ChatCodec`
and generation through any :class:`~verl_bpo.rollout.protocols.LLMClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from typing import Any, Literal, TypeVar

from sandbox_adapters.base import Observation, Sandbox, Snapshot, SnapshotKind, StepResult
from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.rollout.metrics import tree_metrics
from verl_bpo.rollout.protocols import ChatCodec, LLMClient, Transcript
from verl_bpo.rollout.sandbox_calls import SandboxCalls
from verl_bpo.rollout.scoring import ForkScorer, mean_surprisal
from verl_bpo.rollout.tree_state import Anchor, Branch, TreeResult, TreeState, derive_seed

__all__ = ["TreeSampler"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Snapshot kinds cheap enough to take before every step, so that a failed step is retried from a snapshot of the
# state just before it; other kinds (a filesystem layer, a forked process) keep their fork's snapshot and replay.
CHEAP_SNAPSHOTS = frozenset({SnapshotKind.NATIVE, SnapshotKind.REPLAY})

MISSING_LOG_PROBS = (
    "the LLM server returned no log-probabilities for a turn; the tree's fork scores and verl's rollout "
    "correction need them. Set actor_rollout_ref.rollout.calculate_log_probs=True."
)


@dataclasses.dataclass(frozen=True)
class _Unstarted:
    """Why the episode never started, and the system prompt of the sandbox that failed."""

    error: str
    system_prompt: str


@contextlib.asynccontextmanager
async def _branch_tasks() -> AsyncIterator[asyncio.TaskGroup]:
    """A task group for a tree's branches: the first error (e.g. a misconfigured server) cancels the others, so none
    runs on after the tree closes its sandboxes, and is the tree's error, raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None


async def _together(coroutines: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coroutines`` concurrently in one :func:`_branch_tasks` group; their results, in order."""
    async with _branch_tasks() as group:
        tasks = [group.create_task(coroutine) for coroutine in coroutines]
    return [task.result() for task in tasks]


class TreeSampler:
    """Grows one tree. Create one per task (per verl uid) and ``await run()`` once.

    Args:
        config: the ``bpo`` settings, with ``mode`` resolved (:meth:`BPOConfig.for_estimator`).
        rollout_n: N, verl's ``actor_rollout_ref.rollout.n``.
        response_length: token budget of one leaf's response (verl's ``rollout.response_length``).
        make_sandbox: a fresh, un-reset sandbox per call.
        task: the task the sandbox is reset with.
        llm, codec: generation and tokenization.
        tree_id: verl's uid of the task.
        sampling_params: passed to every generation (``max_tokens`` is set per turn).
        policy: the worker's :class:`ForkPolicy` (learns across trees); a fresh one when omitted.
        seed: the tree's seed: its plan's draws and its root branch's seed (module docstring) derive from it.
        root_budget: what the tree may spend under a learned allocation, in ``bpo.learned.budget_unit``
            (:meth:`ForkPolicy.start_tree`); ``None``: N flat rollouts' worth, learned from earlier trees.
        task_key: names the task for the policy (its per-task episode cost); ``None``: not tracked.
        unique_request_ids: give every generation its own request id (``<tree id>-<n>``) instead of the tree's one.
            Needed where the client hands the id to the engine unchanged (verl with
            ``rollout.full_determinism=True``), since concurrent requests with one id collide there; routing then
            follows each id (verl hashes it) instead of sticking to one server.
        seeded_turns: give every generation a ``seed`` in its sampling parameters, derived from its branch's seed
            and depth, so that a turn's sample depends on neither the batch the server put it in nor the order in
            which concurrent branches asked (for engines that honor per-request seeds: vLLM, the in-process
            :class:`~verl_bpo.local.hf_client.BatchedHFClient`); a forking tree then grows in waves (module
            docstring), so its shape is the same however long its sandboxes take.
        policy_learns: the policy learns from the tree as it finishes; ``False``: the caller teaches it from
            ``TreeResult.record`` (:class:`~verl_bpo.local.trainer.LocalRL` does, in task order, so that what a
            batch of concurrent trees teaches does not depend on which finished first).
    """

    RESET_ATTEMPTS = 2  # a reset that fails twice on fresh sandboxes is not transient: the tree becomes failed leaves

    def __init__(self, config: BPOConfig, rollout_n: int, response_length: int, make_sandbox: Callable[[], Sandbox],
                 task: Mapping[str, Any], llm: LLMClient, codec: ChatCodec, *, tree_id: str,
                 sampling_params: Mapping[str, Any] | None = None, policy: ForkPolicy | None = None,
                 seed: int = 0, root_budget: float | None = None, task_key: str | None = None,
                 unique_request_ids: bool = False, seeded_turns: bool = False, policy_learns: bool = True) -> None:
        self.config = config
        self.rollout_n = rollout_n
        self.response_length = response_length
        self.make_sandbox = make_sandbox
        self.task = dict(task)
        self.llm, self.codec = llm, codec
        self.request_id = f"bpo-{tree_id}"  # one id per tree: sticky routing to one server's prefix cache
        self.unique_request_ids = unique_request_ids
        self.seeded_turns = seeded_turns
        self.policy_learns = policy_learns
        self.generations = 0
        self.sampling_params = dict(sampling_params or {})
        self.policy = policy if policy is not None else ForkPolicy(config)
        self.tree = TreeState(tree_id)
        self.scorer = ForkScorer(config, llm, self.next_request_id, self.turn_params, self.tree)
        self.calls = SandboxCalls(config.step_timeout_s)
        self.seed = seed
        self.root_budget = root_budget
        self.task_key = task_key

    # --- the tree, top to bottom --------------------------------------------------------------------------------
    async def run(self) -> TreeResult:
        rng = random.Random(self.seed)
        self.plan = plan = self.policy.start_tree(self.rollout_n, seed=rng.randrange(2**31),
                                                  root_budget=self.root_budget, task_key=self.task_key)
        self.root_seed = rng.randrange(2**31)
        start = time.perf_counter()
        try:
            started = await self._start_episode()
            if isinstance(started, _Unstarted):
                return await self._unstarted_tree(started)
            root = await self._root_branch(*started)
            self.tree.branches = [root, *await self._fork(root, plan.root_width)]
            if plan.waves or (self.seeded_turns and plan.kind != "flat"):
                await self._grow_in_waves()
            else:
                await self._grow_branches(self.tree.branches)
        finally:
            await asyncio.gather(*(self._close(b) for b in self.tree.open_sandboxes()))
            self.tree.wall_s = time.perf_counter() - start
        record = self.policy.finish_tree(plan, self.tree.record(self.task_key), learn=self.policy_learns)
        return dataclasses.replace(self._result(), record=record)

    async def _grow_in_waves(self) -> None:
        """Every live branch advances one turn per wave, and the wave's branches are told and decide in the tree's
        branch order: a plan that ranks a wave's candidates sees them all, and no amount or width depends on which
        branch's sandbox answered first."""
        while active := self.tree.active():
            for branch in active:
                self._tell("node", branch)
            if self.config.anticipating:  # the biased ablation draws the kept turn before deciding
                await _together(self._draw_pending(b) for b in active)
            await self._decide([b for b in active if b.node != 0])
            await _together(self._act(b) for b in active)
            for branch in active:
                if branch.done:
                    self._tell("end", branch)

    async def _grow_branches(self, branches: list[Branch]) -> None:
        """Every branch goes its own pace, deciding at each node as it reaches it: no branch waits for a slower
        one, and generation and sandbox steps of different branches overlap."""
        async with _branch_tasks() as group:
            for branch in branches:
                group.create_task(self._grow_branch(branch, group))

    async def _grow_branch(self, branch: Branch, group: asyncio.TaskGroup) -> None:
        while not branch.done:
            self._tell("node", branch)
            if self.config.anticipating:
                await self._draw_pending(branch)
            if branch.node != 0:
                for child in await self._decide([branch]):
                    group.create_task(self._grow_branch(child, group))
            await self._act(branch)
        self._tell("end", branch)

    async def _decide(self, branches: list[Branch]) -> list[Branch]:
        """Read every eligible node from its own frozen view, then fork the ones the plan widens; returns the new
        branches."""
        plan = self.plan
        views = [(b, b.view(self.config.max_turns)) for b in branches]
        candidates = [(b, v) for b, v in views if plan.eligible(v)]
        if plan.uses_scores:  # one group: a failing score cancels the others (probes would outlive the tree)
            scores = await _together(self.scorer(b, v) for b, v in candidates)
        else:
            scores = [0.0] * len(candidates)
        forked: list[Branch] = []
        for (branch, _), width in zip(candidates, plan.widths([v for _, v in candidates], scores)):
            if width >= 2 and (children := await self._fork(branch, width)):
                self.tree.forks += 1
                self.tree.branches.extend(children)
                forked.extend(children)
        return forked

    def _tell(self, event: Literal["fork", "node", "turn", "end"], branch: Branch, *siblings: Branch,
              planned: int = 0, tokens: int = 0) -> None:
        """The one place the sampler tells the plan's budget what ``branch`` did, and sets the amounts it hands back.

        ``"fork"``: a fork the plan sized ``planned`` made ``siblings`` (fewer when snapshots or restores failed);
        the node's amount is split among them and ``branch``. ``"node"``: the branch is about to decide at its next
        node and takes its share of what ended branches left. ``"turn"``: it took a turn that generated ``tokens``,
        whose cost it spends. ``"end"``: its episode ended; what it holds goes back to the pool.
        """
        budget = self.plan.budget
        if event == "fork":
            for b, amount in zip((branch, *siblings), budget.on_fork(branch.budget, planned, 1 + len(siblings))):
                b.budget = amount
        elif event == "node":
            branch.budget = budget.on_node(branch.budget, running=len(self.tree.active()))
        elif event == "turn":
            branch.budget = budget.on_turn(branch.budget, tokens)
        elif event == "end":
            budget.on_leaf_end(branch.budget)
        else:
            raise ValueError(f"unknown budget event {event!r}")

    # --- episode start ------------------------------------------------------------------------------------------
    async def _start_episode(self) -> tuple[Sandbox, Observation] | _Unstarted:
        """The root sandbox and its first observation; a failed reset is retried on a fresh sandbox
        (``RESET_ATTEMPTS`` in all)."""
        unstarted = _Unstarted("no reset attempted", "")
        for _ in range(self.RESET_ATTEMPTS):
            try:
                box = self.make_sandbox()
            except Exception as exc:  # e.g. the sandbox's runtime (Docker, bwrap) is missing on this node
                logger.warning("tree %s: sandbox could not be created: %r", self.tree.tree_id, exc)
                unstarted = _Unstarted(f"{type(exc).__name__}: {exc}", "")
                continue
            try:
                observation = await self.calls("reset", box, "reset", self.task)
                # The root's own randomness is the tree's, as every child's is (restore re-seeds them): a reset
                # seed alone would give every tree of a task the same transitions on its first branch.
                await self.calls("reset", box, "reseed", derive_seed(self.root_seed, "reset"))
                return box, observation
            except Exception as exc:
                logger.warning("tree %s: sandbox reset failed: %r", self.tree.tree_id, exc)
                unstarted = _Unstarted(f"{type(exc).__name__}: {exc}", box.system_prompt())
                await self.calls.close(box)
        return unstarted

    async def _root_branch(self, box: Sandbox, observation: Observation) -> Branch:
        messages = box.opening_chat(observation)
        prompt_ids = await self.codec.start(messages)
        return Branch(0, box, Transcript(messages, list(prompt_ids), len(prompt_ids)), [0], [], 1.0,
                      seed=self.root_seed, budget=self.plan.budget.root_budget)

    async def _unstarted_tree(self, unstarted: _Unstarted) -> TreeResult:
        """N failed leaves when the episode never started, so verl's uid group stays whole (a group with no
        trajectories stops verl's training step). Each leaf is one empty turn: its response is a mask-0 note, its
        reward 0, and all leaves are flat siblings, so every advantage in the group is 0."""
        note = unstarted.error
        messages = [{"role": "system", "content": unstarted.system_prompt},
                    {"role": "user", "content": f"The environment failed to start ({note})."}]
        prompt_ids = await self.codec.start(messages)
        base = Transcript(messages, list(prompt_ids), len(prompt_ids))
        await self.codec.add_user(base, "No episode was played.")
        base.turn_starts.append(0)
        n = self.rollout_n
        for _ in range(n):
            node = self.tree.new_node()
            branch = Branch(node, None, base.copy(), [0, node], [0.0], 1.0 / n, depth=1)
            branch.done, branch.failed, branch.error = True, True, note
            self.tree.branches.append(branch)
        result = self._result()
        result.metrics["bpo/reset_failures"] = 1.0
        result.metrics["bpo/unspent_leaf_budget"] = 0.0
        return result

    def next_request_id(self) -> str:
        """The request id of the tree's next generation (class docstring: ``unique_request_ids``)."""
        if not self.unique_request_ids:
            return self.request_id
        self.generations += 1
        return f"{self.request_id}-{self.generations}"

    # --- forks and turns ----------------------------------------------------------------------------------------
    async def _fork(self, branch: Branch, children: int) -> list[Branch]:
        """The fork of ``branch`` into ``children`` branches that the plan decided: the siblings made, whose amounts
        (and ``branch``'s) the plan's budget sets."""
        siblings = await self._siblings(branch, children) if children >= 2 else []
        self._tell("fork", branch, *siblings, planned=children)
        return siblings

    async def _siblings(self, branch: Branch, children: int) -> list[Branch]:
        """Up to ``children − 1`` siblings of ``branch`` at its node, each with a restored, re-seeded sandbox.

        A failed snapshot or restore makes the fork smaller; that is decided before any child turn is drawn, so
        the tree stays unbiased. ``branch`` and its siblings share the mass ``ω / k`` of the fork's actual size k.
        Where snapshots are not cheap (and ``bpo.step_retries`` > 0) the fork's snapshot stays with its branches,
        which retry a failed step from it (:meth:`_step_with_retries`).
        """
        try:
            snapshot: Snapshot = await self.calls("snapshot", branch.sandbox, "snapshot")
        except Exception as exc:
            logger.warning("tree %s: snapshot failed, node not forked: %r", self.tree.tree_id, exc)
            return []
        siblings, seeds, box = [], [], None
        try:
            for child in range(1, children):
                box, child_seed = None, derive_seed(branch.seed, "child", branch.depth, child)
                seed = derive_seed(child_seed, "restore")
                try:
                    box = self.make_sandbox()
                    await self.calls("restore", box, "restore", snapshot, seed)
                except Exception as exc:
                    logger.warning("tree %s: restore failed, one child fewer: %r", self.tree.tree_id, exc)
                    if box is not None:
                        await self.calls.close(box)
                    box = None
                    continue
                siblings.append(branch.copy_into(box, child_seed))
                seeds.append(seed)
                box = None
        except BaseException:  # cancelled mid-fork: nothing restored so far may outlive the tree
            snapshot.close()
            boxes = [b for b in (box, *(s.sandbox for s in siblings)) if b is not None]
            await asyncio.shield(asyncio.gather(*(self.calls.close(b) for b in boxes), return_exceptions=True))
            raise
        if siblings and self._retries_replay(branch.sandbox):
            anchor = Anchor(snapshot)  # ``branch``'s own sandbox is the one it was taken of: no seed
            for holder, seed in [(branch, None), *zip(siblings, seeds)]:
                holder.hold(anchor, seed)
        else:
            snapshot.close()  # restored children are independent copies; the snapshot is no longer needed
        if siblings:
            mass = branch.mass / (1 + len(siblings))
            forks = branch.forks + (branch.node != 0)  # the root fork does not count against max_forks_per_path
            for b in (branch, *siblings):
                b.mass, b.forks, b.since_fork = mass, forks, 0
        return siblings

    def turn_params(self, branch: Branch, purpose: str, max_tokens: int) -> dict[str, Any]:
        """The sampling parameters of a generation ``branch`` makes at its depth for ``purpose`` (its turn, a
        probe): with ``seeded_turns``, a seed of their own."""
        params = {**self.sampling_params, "max_tokens": max_tokens}
        if self.seeded_turns:
            params["seed"] = derive_seed(branch.seed, purpose, branch.depth)
        return params

    async def _generate(self, branch: Branch) -> tuple[list[int], list[float]]:
        room = self.response_length - len(branch.transcript.response_mask)
        cap = room if self.config.max_tokens_per_turn is None else min(room, self.config.max_tokens_per_turn)
        params = self.turn_params(branch, "turn", max(cap, 1))
        start = time.perf_counter()
        out = await self.llm.generate(self.next_request_id(), prompt_ids=branch.transcript.token_ids,
                                      sampling_params=params)
        self.tree.generate_s += time.perf_counter() - start
        self.tree.track_versions(out)
        token_ids, log_probs = list(out.token_ids), list(out.log_probs or [])
        if len(log_probs) != len(token_ids):
            raise ValueError(MISSING_LOG_PROBS)
        return token_ids, log_probs

    async def _draw_pending(self, branch: Branch) -> None:
        branch.pending = await self._generate(branch)

    async def _act(self, branch: Branch) -> None:
        """One turn: generate (or take the pending draw), step the sandbox, append the observation."""
        # The turn's node is named before anything awaits: in a wave, ids then follow the tree's branch order, not
        # the order in which generations come back.
        node = self.tree.new_node()
        token_ids, log_probs = branch.pending if branch.pending is not None else await self._generate(branch)
        branch.pending = None
        self._tell("turn", branch, tokens=len(token_ids))
        transcript = branch.transcript
        text = await self.codec.add_assistant(transcript, token_ids, log_probs)
        # The codec appends the generated tokens last (it may add or trim boundary tokens before them).
        transcript.turn_starts.append(len(transcript.response_mask) - len(token_ids))
        self.tree.add_turn(node, token_ids, log_probs)
        branch.node, branch.depth, branch.since_fork = node, branch.depth + 1, branch.since_fork + 1
        branch.node_path.append(node)
        branch.last_turn_surprisal = mean_surprisal(log_probs)
        try:
            result = await self._step_with_retries(branch, text)
        except Exception as exc:  # a fault that outlasted its retries ends this leaf only; the failed turn earns 0
            logger.warning("tree %s: a branch failed and becomes a failed leaf: %r", self.tree.tree_id, exc)
            branch.turn_rewards.append(0.0)
            branch.done, branch.failed, branch.error = True, True, f"{type(exc).__name__}: {exc}"
            await self._close(branch)
            return
        branch.turn_rewards.append(float(result.reward))
        out_of_room = len(transcript.response_mask) >= self.response_length
        if result.done or branch.depth >= self.config.max_turns or out_of_room:
            branch.done, branch.truncated, branch.won = True, not result.done, bool(result.info.get("won", False))
            branch.tampered = bool(result.info.get("grading_tampered", False))
            await self._close(branch)
            return
        await self.codec.add_user(transcript, branch.sandbox.render_observation(result.observation))
        if len(transcript.response_mask) >= self.response_length:
            branch.done, branch.truncated = True, True
            await self._close(branch)

    async def _step_with_retries(self, branch: Branch, text: str) -> StepResult:
        """``branch``'s sandbox stepped with ``text``. A step that crashes or hangs is retried up to
        ``bpo.step_retries`` times, each on a fresh sandbox rebuilt at the state before the step (the branch's
        anchor restored, the actions since replayed), re-seeded with a fresh seed, with the same text: a fault that
        does not depend on the action then leaves the path distributed exactly as without it. Raises the last
        attempt's error when every attempt failed."""
        if self.config.step_retries and self._anchors_each_step(branch.sandbox):
            await self._anchor_before_step(branch)
        try:
            result = await self.calls("step", branch.sandbox, "step", text)
        except Exception as exc:
            error = exc
        else:
            branch.replay.append((None, text))
            return result
        retries = self.config.step_retries if branch.anchor is not None else 0  # no anchor: nothing to rebuild
        for attempt in range(retries):
            logger.info("tree %s: retrying a failed step on a rebuilt sandbox: %r", self.tree.tree_id, error)
            self.tree.step_retries += 1
            try:
                return await self._retry_step(branch, text, derive_seed(branch.seed, "retry", branch.depth, attempt))
            except Exception as exc:
                error = exc
        raise error

    def _anchors_each_step(self, sandbox: Sandbox) -> bool:
        """A snapshot before every step: native snapshots always (the retry restores exactly that state), replay
        snapshots where the engine is deterministic (their restore replays the episode)."""
        kind = sandbox.snapshot_kind
        return kind is SnapshotKind.NATIVE or (kind is SnapshotKind.REPLAY and type(sandbox).deterministic)

    def _retries_replay(self, sandbox: Sandbox) -> bool:
        """Retries from the fork's snapshot with the actions since replayed: only for a deterministic engine whose
        snapshots are too costly to take at every step (a non-deterministic one would replay into a state the
        agent never saw)."""
        return (bool(self.config.step_retries) and type(sandbox).deterministic
                and sandbox.snapshot_kind not in CHEAP_SNAPSHOTS)

    async def _anchor_before_step(self, branch: Branch) -> None:
        """A snapshot of the state before the next step becomes the branch's anchor. If it fails, the older anchor
        and the actions since still rebuild this state."""
        try:
            snapshot = await self.calls("recover", branch.sandbox, "snapshot")
        except Exception as exc:
            logger.warning("tree %s: snapshot before a step failed: %r", self.tree.tree_id, exc)
            return
        branch.hold(Anchor(snapshot))

    async def _retry_step(self, branch: Branch, text: str, seed: int) -> StepResult:
        """One retry: a fresh sandbox rebuilt from the branch's anchor, re-seeded with ``seed`` and stepped with
        ``text``. It replaces the branch's sandbox when the step succeeds, and is closed when anything fails."""
        box = self.make_sandbox()
        try:
            await self.calls("recover", box, "restore", branch.anchor.snapshot, branch.anchor_seed)
            for reseed, action in branch.replay:
                if reseed is not None:
                    await self.calls("recover", box, "reseed", reseed)
                await self.calls("recover", box, "step", action)
            await self.calls("recover", box, "reseed", seed)
            result = await self.calls("step", box, "step", text)
        except BaseException:
            await self.calls.close(box)
            raise
        failed, branch.sandbox = branch.sandbox, box
        await self.calls.close(failed)
        branch.replay.append((seed, text))
        return result

    async def _close(self, branch: Branch) -> None:
        branch.let_go()
        if branch.sandbox is not None:
            sandbox, branch.sandbox = branch.sandbox, None
            self.tree.branch_s += time.perf_counter() - branch.born
            await self.calls.close(sandbox)

    # --- result -------------------------------------------------------------------------------------------------
    def _result(self) -> TreeResult:
        leaves = self.tree.leaves(self.response_length, self.config.mask_failed_turns)
        metrics = tree_metrics(self.tree, leaves, self.plan, self.calls.seconds)
        return TreeResult(leaves, metrics, dict(self.tree.weight_versions))
