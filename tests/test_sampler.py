"""TreeSampler on the real smoke sandbox with a scripted (fake) LLM: shape, budget, metadata, faults (T8 too)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import time

import numpy as np
import pytest
import torch

from sandbox_adapters.base import SandboxCrashed, SnapshotKind
from sandbox_adapters.smoke import SmokeSandbox
from tests.fakes import (
    WORD_ID,
    CountingSmoke,
    CrashingSmoke,
    Generation,
    HangingSmoke,
    JitterySmoke,
    ScriptedLLM,
    SeededLLM,
    SlowSnapshotSmoke,
    UnrestorableSmoke,
    UnstartableSmoke,
    WordCodec,
)
from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy, is_eligible
from verl_bpo.core.leaf_meta import build_leaf_rows
from verl_bpo.core.tree import compute_credit
from verl_bpo.integration.estimator import compute_bpo_advantage
from verl_bpo.rollout.sampler import TreeSampler

TASK = {"task_id": 3}


def tree(rollout_n=8, **kw):
    """The ``bpo`` settings of a tree for N = ``rollout_n`` (``mode=tree``), and N."""
    return BPOConfig(mode="tree", **{"max_turns": 6, **kw}), rollout_n


def flat(rollout_n, **kw):
    return BPOConfig(mode="flat", **{"max_turns": 6, **kw}), rollout_n


def grow(shape, sandbox_cls=CountingSmoke, seed=0, response_length=256, policy=None):
    config, rollout_n = shape
    llm = ScriptedLLM(seed)
    sampler = TreeSampler(config, rollout_n, response_length, lambda: sandbox_cls(), TASK, llm, WordCodec(),
                          tree_id="uid-1", seed=seed, policy=policy)
    return asyncio.run(sampler.run()), llm


def leaf_rows(result):
    metas = [leaf.meta for leaf in result.leaves]
    length = max(len(leaf.transcript.response_mask) for leaf in result.leaves)
    totals = np.array([leaf.reward for leaf in result.leaves])
    return build_leaf_rows(metas, ["uid-1"] * len(metas), totals, np.full(len(metas), length),
                           np.ones(len(metas), dtype=bool))


@pytest.mark.parametrize("k,k0", [(2, 2), (3, 2), (2, 4)])
def test_tree_has_exactly_n_leaves_sharing_prefixes(k, k0):
    result, llm = grow(tree(8, fixed={"k": k, "k0": k0}))
    assert len(result.leaves) == 8
    rows = leaf_rows(result)  # the estimator's own validation: unique nodes, masses match the forks
    forest = rows.forest
    assert forest.num_children[0] == k0
    assert np.isclose(forest.masses()[forest.is_leaf].sum(), 1.0)
    # Leaves through the same node share the exact token prefix up to that node.
    by_node = {}
    for leaf in result.leaves:
        for t, node in enumerate(leaf.meta.node_path[1:]):
            end = leaf.meta.turn_spans[t][1]
            prefix = leaf.transcript.token_ids[: leaf.transcript.prompt_length + end]
            by_node.setdefault(node, set()).add(tuple(prefix))
    assert all(len(prefixes) == 1 for prefixes in by_node.values())
    assert result.metrics["bpo/forks"] >= 1 and result.metrics["bpo/leaf_utilization"] == 1.0
    assert set(llm.request_ids) == {"bpo-uid-1"}  # one request id per tree: sticky routing
    assert CountingSmoke.live == 0  # every sandbox closed


def test_flat_mode_is_n_independent_rollouts():
    result, _ = grow(flat(5))
    firsts = {leaf.meta.node_path[1] for leaf in result.leaves}
    assert len(result.leaves) == 5 and len(firsts) == 5
    assert all(np.isclose(leaf.meta.leaf_mass, 1 / 5) for leaf in result.leaves)
    assert result.metrics["bpo/forks"] == 0


def test_a_tree_shares_turns_so_it_costs_fewer_env_steps_than_flat():
    grown, _ = grow(tree(8, fixed={"k": 2, "k0": 2}))
    flat_group, _ = grow(flat(8))
    assert grown.metrics["bpo/env_steps"] < flat_group.metrics["bpo/env_steps"]
    assert grown.metrics["bpo/generated_tokens"] < flat_group.metrics["bpo/generated_tokens"]
    assert grown.metrics["bpo/trainer_rows"] == flat_group.metrics["bpo/trainer_rows"] == 8


def test_estimator_gives_nonzero_advantages_on_a_sampled_tree():
    result, _ = grow(tree(8, fixed={"k": 2, "k0": 2}, max_turns=8), seed=3)
    length = max(len(leaf.transcript.response_mask) for leaf in result.leaves)
    mask = torch.zeros(len(result.leaves), length)
    rewards = torch.zeros_like(mask)
    for i, leaf in enumerate(result.leaves):
        m = leaf.transcript.response_mask
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        rewards[i, len(m) - 1] = leaf.reward
    adv, _ = compute_bpo_advantage(rewards, mask, index=np.array(["uid-1"] * len(result.leaves), dtype=object),
                                   tree_meta=[leaf.meta for leaf in result.leaves])
    assert torch.all(adv[mask == 0] == 0)
    if len({leaf.reward for leaf in result.leaves}) > 1:
        assert adv.abs().sum() > 0


def test_crashed_branches_become_failed_leaves_and_the_tree_completes():
    result, _ = grow(tree(8, fixed={"k": 2, "k0": 2}, step_retries=0), sandbox_cls=CrashingSmoke, seed=1)  # no retries
    failed = [leaf for leaf in result.leaves if leaf.failed]
    assert len(result.leaves) == 8 and failed
    assert all(leaf.reward == 0 and leaf.meta.failed and "injected crash" in leaf.error for leaf in failed)
    leaf_rows(result)  # still a valid tree
    assert result.metrics["bpo/failed_leaves"] == len(failed)
    assert CountingSmoke.live == 0


def test_a_hanging_step_times_out_into_a_failed_leaf():
    result, _ = grow(tree(4, fixed={"k": 2, "k0": 2}, step_timeout_s=0.3, max_turns=4), sandbox_cls=HangingSmoke)
    assert all(leaf.failed and "SandboxTimeout" in leaf.error for leaf in result.leaves)
    assert len(result.leaves) == 4


def test_failed_restores_shrink_the_fork_but_keep_masses_right():
    UnrestorableSmoke.calls = 0
    result, _ = grow(tree(8, fixed={"k": 3, "k0": 3}), sandbox_cls=UnrestorableSmoke)
    rows = leaf_rows(result)
    assert np.isclose(rows.forest.masses()[rows.forest.is_leaf].sum(), 1.0)
    assert UnrestorableSmoke.calls >= 2  # restores failed ...
    assert len(result.leaves) <= 8  # ... and the leaves they did not make went back to the budget, never over it


def test_a_failed_reset_is_retried_on_a_fresh_sandbox():
    UnstartableSmoke.failures, UnstartableSmoke.resets = 1, 0
    result, _ = grow(tree(4, fixed={"k": 2, "k0": 2}), sandbox_cls=UnstartableSmoke)
    assert len(result.leaves) == 4 and not any(leaf.failed for leaf in result.leaves)
    assert result.metrics["bpo/reset_failures"] == 0
    assert CountingSmoke.live == 0


def test_a_tree_that_cannot_start_gives_n_failed_leaves_with_zero_advantage():
    """verl stops the step when a uid group has no trajectories, so a dead reset must still fill the group."""
    UnstartableSmoke.failures, UnstartableSmoke.resets = 10, 0
    result, _ = grow(tree(4, fixed={"k": 2, "k0": 2}), sandbox_cls=UnstartableSmoke)
    assert len(result.leaves) == 4 and all(leaf.failed and "injected reset failure" in leaf.error
                                           for leaf in result.leaves)
    assert UnstartableSmoke.resets == TreeSampler.RESET_ATTEMPTS
    assert result.metrics["bpo/reset_failures"] == 1 and result.metrics["bpo/failed_leaves"] == 4
    for leaf in result.leaves:  # a non-empty response (verl writes the reward on its last token), all mask 0
        assert leaf.transcript.response_mask and not any(leaf.transcript.response_mask)
    rows = leaf_rows(result)
    assert np.isclose(rows.forest.masses()[rows.forest.is_leaf].sum(), 1.0)
    assert CountingSmoke.live == 0


def test_posthoc_score_is_flagged_and_still_runs():
    result, _ = grow(tree(6, fixed={"k": 2, "k0": 2}, ablation={"kept_turn_surprisal": True}))
    assert len(result.leaves) == 6


def test_next_token_entropy_needs_a_capable_client():
    with pytest.raises(ValueError, match="probe_surprisal"):
        TreeSampler(BPOConfig(mode="tree", fixed={"score": "next_token_entropy"}), 8, 256, CountingSmoke, TASK,
                    ScriptedLLM(), WordCodec(), tree_id="t")


def test_probe_score_spends_extra_generations():
    result, llm = grow(tree(6, fixed={"k": 2, "k0": 2, "score": "probe_surprisal", "probe_tokens": 2}))
    assert len(result.leaves) == 6
    assert len(llm.request_ids) > result.metrics["bpo/env_steps"]  # probes are discarded generations
    assert result.metrics["bpo/generated_tokens"] > result.metrics["bpo/env_steps"] * 2  # and count as compute


def test_a_failed_fork_score_cancels_the_other_scores_of_its_wave():
    """A probe that fails is the tree's error, and the wave's other probes, still generating, are cancelled with it
    before the tree returns: none runs on after the tree has closed its sandboxes."""

    class FailingProbes(ScriptedLLM):
        def __init__(self) -> None:
            super().__init__()
            self.probes, self.hanging, self.cancelled = 0, 0, 0

        async def generate(self, request_id, *, prompt_ids, sampling_params):
            if sampling_params.get("max_tokens") != 1:  # a turn (probes take probe_tokens = 1)
                return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            self.probes += 1
            if self.probes == 1:
                await asyncio.sleep(0.01)  # the others start first
                raise RuntimeError("probe failed")
            self.hanging += 1
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    llm = FailingProbes()
    config, n = tree(8, fixed={"k": 2, "k0": 4, "score": "probe_surprisal", "probe_tokens": 1,
                               "selector": "topB_wave"})  # waves: one _decide scores many

    async def run() -> None:
        sampler = TreeSampler(config, n, 256, CountingSmoke, TASK, llm, WordCodec(), tree_id="t")
        with pytest.raises(RuntimeError, match="probe failed"):
            await sampler.run()
        # read before asyncio.run's shutdown cancels whatever is left
        assert llm.hanging >= 2 and llm.cancelled == llm.hanging

    asyncio.run(run())
    assert CountingSmoke.live == 0


def test_credit_on_sampled_trees_is_finite():
    result, _ = grow(tree(8, fixed={"k": 2, "k0": 2}), seed=5)
    credit = compute_credit(leaf_rows(result).forest)
    assert np.all(np.isfinite(credit.advantage))


def test_success_rate_counts_won_leaves():
    class Solver(ScriptedLLM):
        """Always plays the task's solution (the fake knows the smoke layout)."""

        def __init__(self):
            super().__init__()
            self.plan = CountingSmoke().solution(TASK)
            CountingSmoke.live -= 1

        async def generate(self, request_id, *, prompt_ids, sampling_params):
            turn = sum(1 for t in prompt_ids if t == 1)  # one <eos> per earlier turn
            ids = [WORD_ID[w] for w in self.plan[min(turn, len(self.plan) - 1)].split()] + [WORD_ID["<eos>"]]
            return Generation(ids, [-0.1] * len(ids))

    config = BPOConfig(mode="tree", fixed={"k": 2, "k0": 2}, max_turns=8)
    result = asyncio.run(TreeSampler(config, 4, 512, CountingSmoke, TASK, Solver(), WordCodec(), tree_id="s").run())
    assert result.metrics["bpo/success_rate"] == 1.0 and all(leaf.won for leaf in result.leaves)
    assert result.metrics["bpo/leaf_return"] == 1.0


def test_a_failed_leaf_keeps_shared_prefix_rewards_consistent():
    """With rewards earned before a crash, the failed leaf's shared turns must carry the same reward as its
    siblings' copies (the estimator rejects one turn with two rewards)."""

    class ShapedCrashingSmoke(CrashingSmoke):
        def __init__(self, config=None):
            super().__init__(type(self).Config(key_reward=0.5, length=2))

    CrashingSmoke.rng.seed(3)
    for seed in range(4):
        result, _ = grow(tree(8, fixed={"k": 2, "k0": 2}), sandbox_cls=ShapedCrashingSmoke, seed=seed)
        leaf_rows(result)  # raises on inconsistent shared rewards
        assert all(leaf.reward == sum(leaf.meta.turn_rewards) for leaf in result.leaves)


@pytest.mark.slow  # generates a TextWorld game (tw-make) for itself
@pytest.mark.envs
def test_concurrent_trees_on_a_thread_unsafe_engine_do_not_crash(tmp_path):
    """TextWorld corrupts its shared grammar parser under concurrent resets; the sampler serializes its calls."""
    pytest.importorskip("textworld")
    from sandbox_adapters.textworld import TextWorldSandbox, make_games

    game = make_games(tmp_path, [0])[0]
    config = BPOConfig(mode="tree", fixed={"k": 2, "k0": 2}, max_turns=3)

    async def trees():
        samplers = [TreeSampler(config, 4, 4096, lambda: TextWorldSandbox(TextWorldSandbox.Config(max_steps=3)),
                                {"game": str(game)}, ScriptedLLM(i), WordCodec(), tree_id=f"t{i}", seed=i)
                    for i in range(4)]
        return await asyncio.gather(*(s.run() for s in samplers))

    for result in asyncio.run(trees()):
        assert len(result.leaves) == 4 and not any(leaf.failed for leaf in result.leaves)


class RecordingPolicy(ForkPolicy):
    """The production fork policy, recording when each node's decision was taken (counted in LLM calls)."""

    def __init__(self, config, llm):
        super().__init__(config)
        self.llm, self.decided_at, self.declared = llm, {}, {}

    def start_tree(self, rollout_n, seed=0, root_budget=None, task_key=None):
        plan = super().start_tree(rollout_n, seed, root_budget, task_key)
        self.decided_at, self.declared = {}, {}  # per tree: node ids and histories repeat across trees
        self.root_width = plan.root_width
        eligible, widths = plan.eligible, plan.widths
        pending = []

        def record_eligible(view):
            self.decided_at.setdefault(view.history, len(self.llm.request_ids))
            pending.append(view)
            return eligible(view)

        def record_widths(views, scores):
            out = widths(views, scores)
            eligible_views = [v for v in pending if is_eligible(v, self.config)]
            self.declared.update({v.node_id: w for v, w in zip(eligible_views, out)})
            pending.clear()
            return out

        plan.eligible, plan.widths = record_eligible, record_widths
        return plan


@pytest.mark.parametrize("rule,anticipates", [("parent_turn_surprisal", False), ("kept_turn_surprisal", True),
                                               ("learned", False)])
def test_T8_no_child_is_drawn_before_its_nodes_fork_decision(rule, anticipates):
    """An instrumented run of the production sampler: every turn drawn from a node's history comes after that
    node's fork decision; the posthoc ablation, which draws the kept turn first, is caught by the same check.
    The root forks into its planned K0 and every branch node has the width its plan declared."""
    if rule == "learned":
        config = BPOConfig(mode="tree", allocation="learned", max_turns=6,
                           learned={"warmup_trees": 5, "explore_share": 0.2})
    elif rule == "kept_turn_surprisal":
        config = BPOConfig(mode="tree", fixed={"k": 2, "k0": 3}, max_turns=6, ablation={"kept_turn_surprisal": True})
    else:
        config = BPOConfig(mode="tree", fixed={"k": 2, "k0": 3, "score": rule}, max_turns=6)
    llm = ScriptedLLM(0)
    llm.prompts = []
    generate = llm.generate

    async def recording_generate(request_id, *, prompt_ids, sampling_params):
        llm.prompts.append((tuple(prompt_ids), len(llm.request_ids)))
        return await generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    llm.generate = recording_generate
    policy = RecordingPolicy(config, llm)
    late = []
    for i in range(20):
        llm.prompts.clear()
        result = asyncio.run(TreeSampler(config, 9, 256, CountingSmoke, TASK, llm, WordCodec(), tree_id=f"t{i}",
                                         seed=i, policy=policy).run())
        late += [call for prompt, call in llm.prompts
                 if prompt in policy.decided_at and call < policy.decided_at[prompt]]
        rows = leaf_rows(result)
        k = rows.forest.num_children
        assert k[0] == policy.root_width >= 2  # the root is a branch node of K0 children
        node_of = {}  # forest index -> sampler node id
        for leaf, node in zip(result.leaves, rows.leaf_node):
            index = node
            for node_id in reversed(leaf.meta.node_path):
                node_of[int(index)] = node_id
                index = rows.forest.parent[index]
        for index in np.flatnonzero(k >= 2)[1:]:
            assert policy.declared[node_of[int(index)]] == k[index]
    assert bool(late) is anticipates


@pytest.mark.parametrize("mask_failed", [True, False])
def test_a_crashed_turn_is_masked_out_of_the_loss_by_default(mask_failed):
    """An infrastructure fault is not a negative sample for what the model said: the failing turn's tokens get
    mask 0 (bpo.mask_failed_turns, default); the leaf keeps its earlier turns, its rewards and its mass."""
    CrashingSmoke.rng.seed(1)
    result, _ = grow(tree(8, fixed={"k": 2, "k0": 2}, mask_failed_turns=mask_failed), sandbox_cls=CrashingSmoke, seed=1)
    failed = [leaf for leaf in result.leaves if leaf.failed]
    assert failed
    for leaf in failed:
        start, end = leaf.meta.turn_spans[-1]
        assert any(leaf.transcript.response_mask[start:end]) is not mask_failed
        if leaf.meta.num_turns > 1:
            first_start, _ = leaf.meta.turn_spans[0]
            assert leaf.transcript.response_mask[first_start] == 1  # earlier turns still train
    rows = leaf_rows(result)
    assert np.isclose(rows.forest.masses()[rows.forest.is_leaf].sum(), 1.0)


def test_missing_rollout_log_probs_fail_loudly_and_close_every_sandbox():
    class NoLogProbs(ScriptedLLM):
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            return Generation(out.token_ids, [])

    sampler = TreeSampler(tree(4)[0], 4, 256, CountingSmoke, TASK, NoLogProbs(), WordCodec(), tree_id="t")
    with pytest.raises(ValueError, match="calculate_log_probs=True"):
        asyncio.run(sampler.run())
    assert CountingSmoke.live == 0


def test_success_return_and_turn_length_are_mass_weighted():
    """A tree over-samples the subtrees below its forks; Σ w·won is the policy's expected success, and a flat
    group's plain mean (every mass 1/N), so the two compare directly; so is its turn length."""
    from verl_bpo.core.leaf_meta import LeafMeta
    from verl_bpo.rollout.metrics import tree_metrics
    from verl_bpo.rollout.protocols import Transcript
    from verl_bpo.rollout.tree_state import Leaf, TreeState

    def leaf(path, mass, won, tampered=False):
        meta = LeafMeta("t", 0, path, ((0, 1),) * (len(path) - 1), mass, (float(won),) * (len(path) - 1))
        return Leaf(Transcript([], [0], 0, [1]), meta, float(won), won=won, tampered=tampered)

    leaves = [leaf((0, 1), 0.5, True), leaf((0, 2, 3), 0.25, False, True), leaf((0, 2, 4), 0.25, False)]
    plan = ForkPolicy(BPOConfig(mode="tree")).start_tree(3)
    state = TreeState("t")
    state.turn_tokens = {1: 4.0, 2: 2.0, 3: 6.0, 4: 4.0}  # generated tokens of the turn into each node
    metrics = tree_metrics(state, leaves, plan, {})
    assert metrics["bpo/success_rate"] == 0.5 and metrics["bpo/leaf_return"] == 0.5  # plain means would be 1/3
    # the policy's turn length: 0.5·4 + 0.25·(2+6)/2 + 0.25·(2+4)/2; the tree's tokens per step, 16/4, is not it
    assert metrics["bpo/turn_tokens"] == 3.75
    assert metrics["bpo/grading_tampered"] == 1.0  # counted, like failed leaves


def test_every_tree_draws_its_own_root_transitions():
    """The root sandbox is re-seeded from the tree's seed after its reset, as forked children are: otherwise every
    tree of a task would repeat the same random transitions on its first branch."""
    outcomes = set()
    for seed in range(8):
        sampler = TreeSampler(flat(1)[0], 1, 256, lambda: SmokeSandbox(SmokeSandbox.Config(slip_prob=0.5)), TASK,
                              ScriptedLLM(0, {"east": 1.0}), WordCodec(), tree_id="t", seed=seed)
        leaf = asyncio.run(sampler.run()).leaves[0]
        outcomes.add(tuple(m["content"] for m in leaf.transcript.messages[3::2]))
    assert len(outcomes) > 1


@pytest.mark.parametrize("shape", [
    dict(fixed={"selector": "quantile", "k": 2}),
    dict(allocation="learned", learned={"budget_unit": "turns", "warmup_trees": 4, "max_leaves": 6}),
    dict(allocation="learned", learned={"budget_unit": "leaves", "warmup_trees": 100}),
])
def test_branches_deciding_while_a_fork_restores_stay_within_the_budget(shape):
    """Branches grow at their own pace, so one decides while another's snapshot is still being taken on a worker
    thread: a fork's leaves are reserved when it is decided, or both would spend the same leaves (a tree over its
    cap, whose extra leaves verl has no session for, or a fork that does not fit)."""
    config, n = tree(4, **shape)
    cap = config.leaf_cap(n)
    policy = ForkPolicy(config)
    for seed in range(12):
        result, _ = grow((config, n), sandbox_cls=SlowSnapshotSmoke, seed=seed, policy=policy)
        assert len(result.leaves) <= cap
        leaf_rows(result)  # masses and paths still make one tree
    assert SlowSnapshotSmoke.live == 0


@pytest.mark.parametrize("allocation", ["learned", "fixed"])
def test_seeded_trees_are_the_same_whichever_branch_reaches_its_node_first(allocation):
    """With seeded turns a tree is a function of its seeds: its widths and amounts must not follow which branch's
    sandbox answered first (the budget's pool of unspent tokens, the plan's rounding draws and the leaf cap go to
    whoever asks first), nor its node ids on which generation came back first. Steps take a random 0-5 ms on worker
    threads and generations 0-2 ms, drawn differently in each run of the same 16 trees. The learned plan is taught
    a task decided by its last turn, so it forks late, where paths that already won hand their unspent tokens on."""
    from tests.test_allocation import walk_then_door

    if allocation == "learned":
        config = BPOConfig(mode="tree", allocation="learned", max_turns=8,
                           learned={"budget_unit": "tokens", "warmup_trees": 0, "explore_share": 0.0,
                                    "max_leaves": 16})
    else:
        config = BPOConfig(mode="tree", max_turns=8, fixed={"selector": "quantile", "k": 2})

    def trees(jitter_seed):
        JitterySmoke.rng.seed(jitter_seed)
        SeededLLM.jitter.seed(jitter_seed)
        policy, out = ForkPolicy(config), []
        for record in walk_then_door():
            policy.learn(record)
        for i in range(16):
            sampler = TreeSampler(config, 4, 256, JitterySmoke, TASK, SeededLLM(), WordCodec(), tree_id=f"t{i}",
                                  seed=i, policy=policy, seeded_turns=True, root_budget=96.0)
            result = asyncio.run(sampler.run())
            out.append([(leaf.meta.node_path, tuple(leaf.transcript.token_ids), leaf.meta.leaf_mass)
                        for leaf in result.leaves])
        return out

    first = trees(0)
    # most trees fork below their roots: a node past the root that two or more leaves pass through
    forked = [collections.Counter(node for path, _, _ in leaves for node in path[1:]) for leaves in first]
    assert sum(max(count.values()) > 1 for count in forked) >= 8
    assert trees(1) == first and trees(2) == first
    assert JitterySmoke.live == 0


# --- a step that crashes or hangs is retried from the state before it (bpo.step_retries) ------------------------


class FlakyAfterStepSmoke(CountingSmoke):
    """Fault injection: a step crashes with probability ``crash_prob`` *after* the engine moved, so only a sandbox
    rebuilt at the state before the step can retry it; moves slip at random, so a rebuild must also re-seed as the
    branch was. Records every step attempt, and counts the snapshots not yet closed."""

    crash_prob = 0.15
    rng = random.Random(0)
    attempts: list[tuple[int, tuple, str, bool]] = []  # (sandbox id, state before, action text, crashed)
    open_snapshots = 0

    def __init__(self, config=None):
        super().__init__(config or SmokeSandbox.Config(slip_prob=0.3))

    def step(self, action_text):
        before = (self._state.room, self._state.has_key, self._state.steps, self.actions)
        result = super().step(action_text)
        crashed = self.rng.random() < self.crash_prob
        FlakyAfterStepSmoke.attempts.append((id(self), before, action_text, crashed))
        if crashed:
            raise SandboxCrashed("injected crash after the step")
        return result

    def snapshot(self):
        FlakyAfterStepSmoke.open_snapshots += 1

        def release():
            FlakyAfterStepSmoke.open_snapshots -= 1

        return dataclasses.replace(super().snapshot(), release=release)


class FlakyFilesystemSmoke(FlakyAfterStepSmoke):
    """The same with a snapshot kind too costly to take before every step: a retry restores the branch's last fork
    snapshot and replays the actions since."""

    snapshot_kind = SnapshotKind.FILESYSTEM


@pytest.mark.parametrize("sandbox_cls", [FlakyAfterStepSmoke, FlakyFilesystemSmoke])
def test_a_crashed_step_is_retried_with_the_same_text_from_the_state_before_it(sandbox_cls):
    FlakyAfterStepSmoke.rng.seed(0)
    FlakyAfterStepSmoke.attempts, FlakyAfterStepSmoke.open_snapshots = [], 0
    retries = 0
    for seed in range(4):
        # Replayed steps crash too (the filesystem route replays up to 5): 16 retries make a failed leaf rare.
        result, _ = grow(tree(8, fixed={"k": 2, "k0": 2}, step_retries=16), sandbox_cls=sandbox_cls, seed=seed)
        assert len(result.leaves) == 8 and not any(leaf.failed for leaf in result.leaves)
        leaf_rows(result)  # a valid tree
        retries += result.metrics["bpo/step_retries"]
    attempts = FlakyAfterStepSmoke.attempts
    crashed = [i for i, attempt in enumerate(attempts) if attempt[3]]
    assert crashed and retries == len(crashed)  # every crash was retried, and counted
    for i in crashed:
        box, before, text, _ = attempts[i]
        retry = next((a for a in attempts[i + 1:] if a[1][3] == before[3]), None)  # next after the same actions
        assert retry is not None and retry[0] != box, "a retry runs on a fresh sandbox"
        assert retry[1] == before, "the retried step starts from the state before the crashed one"
        assert retry[2] == text, "the retry applies the same action text"
    assert CountingSmoke.live == 0 and FlakyAfterStepSmoke.open_snapshots == 0  # recovery sandboxes, snapshots closed


@pytest.mark.parametrize("sandbox_cls", [FlakyAfterStepSmoke, FlakyFilesystemSmoke])
def test_a_step_that_fails_every_retry_ends_its_leaf_and_closes_what_recovery_made(sandbox_cls, monkeypatch):
    monkeypatch.setattr(FlakyAfterStepSmoke, "crash_prob", 1.0)
    FlakyAfterStepSmoke.open_snapshots = 0
    result, _ = grow(tree(4, fixed={"k": 2, "k0": 2}, step_retries=2), sandbox_cls=sandbox_cls)
    # Both root branches fail their first step on every attempt: two failed leaves, two retries each.
    assert len(result.leaves) == 2 and all(leaf.failed and "injected crash" in leaf.error for leaf in result.leaves)
    assert result.metrics["bpo/failed_leaves"] == 2 and result.metrics["bpo/step_retries"] == 4
    assert CountingSmoke.live == 0 and FlakyAfterStepSmoke.open_snapshots == 0


class HangOnceSmoke(CountingSmoke):
    """Fault injection: the first third step (across instances) hangs far past the sampler's timeout."""

    blocking = True  # it sleeps: it must run on a worker thread, where the time limit applies
    hung = False

    def _apply(self, action):
        if len(self.actions) == 2 and not HangOnceSmoke.hung:
            HangOnceSmoke.hung = True
            time.sleep(1.0)
        return super()._apply(action)


@pytest.mark.timing  # a normal step must return within the 0.3 s limit, or it is retried too
def test_a_hanging_step_is_retried_on_a_fresh_sandbox():
    HangOnceSmoke.hung = False
    result, _ = grow(tree(4, fixed={"k": 2, "k0": 2}, step_timeout_s=0.3, max_turns=4), sandbox_cls=HangOnceSmoke)
    assert HangOnceSmoke.hung and not any(leaf.failed for leaf in result.leaves)
    assert result.metrics["bpo/step_retries"] == 1
    deadline = time.monotonic() + 3  # the hung sandbox is closed on a thread of its own, without waiting
    while CountingSmoke.live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert CountingSmoke.live == 0
