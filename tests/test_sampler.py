"""TreeSampler on the real smoke sandbox with a scripted (fake) LLM: shape, budget, metadata, faults (T8 too)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.fakes import (
    WORD_ID,
    CountingSmoke,
    CrashingSmoke,
    Generation,
    HangingSmoke,
    ScriptedLLM,
    UnrestorableSmoke,
    UnstartableSmoke,
    WordCodec,
)
from verl_bpo.branching import BranchingConfig
from verl_bpo.estimator import compute_bpo_advantage
from verl_bpo.sampler import SamplerConfig, TreeSampler
from verl_bpo.tree import compute_credit
from verl_bpo.tree_meta import build_leaf_rows

TASK = {"task_id": 3}


def grow(branching: BranchingConfig, sandbox_cls=CountingSmoke, seed=0, **config_kw):
    config = SamplerConfig(branching=branching, max_turns=config_kw.pop("max_turns", 6), response_length=256,
                           **config_kw)
    llm = ScriptedLLM(seed)
    sampler = TreeSampler(config, lambda: sandbox_cls(), TASK, llm, WordCodec(), tree_id="uid-1", seed=seed)
    return asyncio.run(sampler.run()), llm


def leaf_rows(result):
    metas = [leaf.meta for leaf in result.leaves]
    length = max(len(leaf.transcript.response_mask) for leaf in result.leaves)
    totals = np.array([leaf.reward for leaf in result.leaves])
    return build_leaf_rows(metas, ["uid-1"] * len(metas), totals, np.full(len(metas), length),
                           np.ones(len(metas), dtype=bool))


@pytest.mark.parametrize("k,k0", [(2, 2), (3, 2), (2, 4)])
def test_tree_has_exactly_n_leaves_sharing_prefixes(k, k0):
    result, llm = grow(BranchingConfig(n_leaves=8, k=k, k0=k0))
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
    result, _ = grow(BranchingConfig(n_leaves=5, k0=5))
    firsts = {leaf.meta.node_path[1] for leaf in result.leaves}
    assert len(result.leaves) == 5 and len(firsts) == 5
    assert all(np.isclose(leaf.meta.leaf_mass, 1 / 5) for leaf in result.leaves)
    assert result.metrics["bpo/forks"] == 0


def test_a_tree_shares_turns_so_it_costs_fewer_env_steps_than_flat():
    tree, _ = grow(BranchingConfig(n_leaves=8, k=2, k0=2), max_turns=6)
    flat, _ = grow(BranchingConfig(n_leaves=8, k0=8), max_turns=6)
    assert tree.metrics["bpo/turns"] < flat.metrics["bpo/turns"]
    assert tree.metrics["bpo/env_steps_per_leaf"] < flat.metrics["bpo/env_steps_per_leaf"]
    assert tree.metrics["bpo/generated_tokens_per_leaf"] < flat.metrics["bpo/generated_tokens_per_leaf"]


def test_estimator_gives_nonzero_advantages_on_a_sampled_tree():
    result, _ = grow(BranchingConfig(n_leaves=8, k=2, k0=2), seed=3, max_turns=8)
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
    result, _ = grow(BranchingConfig(n_leaves=8, k=2, k0=2), sandbox_cls=CrashingSmoke, seed=1)
    failed = [leaf for leaf in result.leaves if leaf.failed]
    assert len(result.leaves) == 8 and failed
    assert all(leaf.reward == 0 and leaf.meta.failed and "injected crash" in leaf.error for leaf in failed)
    leaf_rows(result)  # still a valid tree
    assert result.metrics["bpo/failed_leaves"] == len(failed)
    assert CountingSmoke.live == 0


def test_a_hanging_step_times_out_into_a_failed_leaf():
    result, _ = grow(BranchingConfig(n_leaves=4, k=2, k0=2), sandbox_cls=HangingSmoke, step_timeout_s=0.3,
                     max_turns=4)
    assert all(leaf.failed and "SandboxTimeout" in leaf.error for leaf in result.leaves)
    assert len(result.leaves) == 4


def test_failed_restores_shrink_the_fork_but_keep_masses_right():
    UnrestorableSmoke.calls = 0
    result, _ = grow(BranchingConfig(n_leaves=8, k=3, k0=3), sandbox_cls=UnrestorableSmoke)
    rows = leaf_rows(result)
    assert np.isclose(rows.forest.masses()[rows.forest.is_leaf].sum(), 1.0)
    assert len(result.leaves) < 8  # restores failed, so some leaves were never created
    assert result.metrics["bpo/leaf_utilization"] < 1.0


def test_a_failed_reset_is_retried_on_a_fresh_sandbox():
    UnstartableSmoke.failures, UnstartableSmoke.resets = 1, 0
    result, _ = grow(BranchingConfig(n_leaves=4, k=2, k0=2), sandbox_cls=UnstartableSmoke)
    assert len(result.leaves) == 4 and not any(leaf.failed for leaf in result.leaves)
    assert result.metrics["bpo/reset_failures"] == 0
    assert CountingSmoke.live == 0


def test_a_tree_that_cannot_start_gives_n_failed_leaves_with_zero_advantage():
    """verl stops the step when a uid group has no trajectories, so a dead reset must still fill the group."""
    UnstartableSmoke.failures, UnstartableSmoke.resets = 10, 0
    result, _ = grow(BranchingConfig(n_leaves=4, k=2, k0=2), sandbox_cls=UnstartableSmoke)
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
    result, _ = grow(BranchingConfig(n_leaves=6, k=2, k0=2, score="kept_turn_surprisal"))
    assert len(result.leaves) == 6


def test_next_token_entropy_needs_a_capable_client():
    with pytest.raises(ValueError, match="probe_surprisal"):
        TreeSampler(SamplerConfig(branching=BranchingConfig(score="next_token_entropy")), CountingSmoke, TASK,
                    ScriptedLLM(), WordCodec(), tree_id="t")


def test_probe_score_spends_extra_generations():
    result, llm = grow(BranchingConfig(n_leaves=6, k=2, k0=2, score="probe_surprisal"), probe_tokens=2)
    assert len(result.leaves) == 6
    assert len(llm.request_ids) > result.metrics["bpo/turns"]  # probes are discarded generations


def test_credit_on_sampled_trees_is_finite():
    result, _ = grow(BranchingConfig(n_leaves=8, k=2, k0=2), seed=5)
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

    config = SamplerConfig(branching=BranchingConfig(n_leaves=4, k=2, k0=2), max_turns=8, response_length=512)
    result = asyncio.run(TreeSampler(config, CountingSmoke, TASK, Solver(), WordCodec(), tree_id="s").run())
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
        result, _ = grow(BranchingConfig(n_leaves=8, k=2, k0=2), sandbox_cls=ShapedCrashingSmoke, seed=seed)
        leaf_rows(result)  # raises on inconsistent shared rewards
        assert all(leaf.reward == sum(leaf.meta.turn_rewards) for leaf in result.leaves)


@pytest.mark.envs
def test_concurrent_trees_on_a_thread_unsafe_engine_do_not_crash(tmp_path):
    """TextWorld corrupts its shared grammar parser under concurrent resets; the sampler serializes its calls."""
    pytest.importorskip("textworld")
    from sandbox_adapters.textworld import TextWorldSandbox, make_games

    game = make_games(tmp_path, [0])[0]
    config = SamplerConfig(branching=BranchingConfig(n_leaves=4, k=2, k0=2), max_turns=3, response_length=4096)

    async def trees():
        samplers = [TreeSampler(config, lambda: TextWorldSandbox(TextWorldSandbox.Config(max_steps=3)),
                                {"game": str(game)}, ScriptedLLM(i), WordCodec(), tree_id=f"t{i}", seed=i)
                    for i in range(4)]
        return await asyncio.gather(*(s.run() for s in samplers))

    for result in asyncio.run(trees()):
        assert len(result.leaves) == 4 and not any(leaf.failed for leaf in result.leaves)
