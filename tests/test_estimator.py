"""The registered `bpo` estimator against verl's own estimators (T1), its metadata checks and the entry point."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import (
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
)

from tests.trees import leaf_batch
from verl_bpo.integration.estimator import compute_bpo_advantage
from verl_bpo.core.leaf_meta import LeafMeta


def run_bpo(batch, **kw):
    return compute_bpo_advantage(batch.token_level_rewards, batch.response_mask, index=batch.uids,
                                 tree_meta=batch.metas, **kw)


@pytest.mark.parametrize("seed", range(5))
def test_T1_flat_tree_equals_verl_rloo(seed):
    batch = leaf_batch(np.random.default_rng(seed), n_trees=4, n_leaves=5, flat=True, per_turn_rewards=False)
    ours, _ = run_bpo(batch)
    theirs, _ = compute_rloo_outcome_advantage(batch.token_level_rewards.clone(), batch.response_mask,
                                               index=batch.uids)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert all(np.isclose(m.leaf_mass, 1 / 5) for m in batch.metas)  # every weight 1/N
    assert ours.abs().sum() > 0


@pytest.mark.parametrize("seed", range(5))
def test_T1_flat_tree_with_mean_incl_self_and_std_equals_verl_grpo(seed):
    batch = leaf_batch(np.random.default_rng(seed), n_trees=4, n_leaves=6, flat=True, per_turn_rewards=False)
    ours, _ = run_bpo(batch, bpo_config={"ablation": {"mean_incl_self": True, "group_std": True}})
    theirs, _ = compute_grpo_outcome_advantage(batch.token_level_rewards.clone(), batch.response_mask,
                                               index=batch.uids, norm_adv_by_std_in_grpo=True)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_registered_under_bpo_in_verls_registry():
    assert get_adv_estimator_fn("bpo") is compute_bpo_advantage


@pytest.mark.slow  # a fresh interpreter importing verl
def test_entry_point_registers_bpo_in_a_fresh_process():
    code = "import verl; from verl.trainer.ppo.core_algos import get_adv_estimator_fn as g; print(g('bpo').__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("compute_bpo_advantage")


def test_tree_advantages_follow_segments_and_masses():
    """A branching batch: each token carries N · w_leaf · A of its turn's segment, env tokens carry 0."""
    batch = leaf_batch(np.random.default_rng(7), n_trees=2, n_leaves=6, k0=2)
    adv, returns = run_bpo(batch)
    assert adv.shape == batch.response_mask.shape
    assert torch.all(adv[batch.response_mask == 0] == 0)
    assert torch.all(returns[batch.response_mask == 0] == 0)
    assert adv.abs().sum() > 0
    # Shared turns: the same turn in two leaves gets advantages in proportion to the two leaf masses.
    by_node = {}
    for row, meta in enumerate(batch.metas):
        for (s, _), node in zip(meta.turn_spans, meta.node_path[1:]):
            by_node.setdefault((meta.tree_id, node), []).append(float(adv[row, s]) / meta.leaf_mass)
    shared = [v for v in by_node.values() if len(v) > 1]
    assert shared
    for values in shared:
        np.testing.assert_allclose(values, values[0], atol=1e-5)


def test_row_order_does_not_matter():
    batch = leaf_batch(np.random.default_rng(3), n_trees=3, n_leaves=7, k0=2)
    adv, _ = run_bpo(batch)
    perm = np.random.default_rng(0).permutation(len(batch.metas))
    adv_p, _ = compute_bpo_advantage(batch.token_level_rewards[perm], batch.response_mask[perm],
                                     index=batch.uids[perm], tree_meta=[batch.metas[i] for i in perm])
    torch.testing.assert_close(adv_p, adv[perm])


def test_padding_rows_get_zero_advantage():
    batch = leaf_batch(np.random.default_rng(11), n_trees=2, n_leaves=4)
    adv, _ = run_bpo(batch)
    # verl's padding: a copy of row 0 with a `pad…` uid, zero mask, copied metadata.
    rewards = torch.cat([batch.token_level_rewards, batch.token_level_rewards[:1]])
    mask = torch.cat([batch.response_mask, torch.zeros_like(batch.response_mask[:1])])
    uids = np.concatenate([batch.uids, np.array(["pad0a1b"], dtype=object)])
    # Padding rows count in verl's loss divisor, so the default scale (rows / trees) grows by one row.
    rows = len(batch.metas)
    adv_pad, _ = compute_bpo_advantage(rewards, mask, index=uids, tree_meta=batch.metas + [batch.metas[0]])
    torch.testing.assert_close(adv_pad[:-1], adv * (rows + 1) / rows)
    assert torch.all(adv_pad[-1] == 0)
    # A padding copy that kept the real uid but has a zero mask is recognised by its duplicated metadata.
    uids_same = np.concatenate([batch.uids, batch.uids[:1]])
    adv_dup, _ = compute_bpo_advantage(rewards, mask, index=uids_same, tree_meta=batch.metas + [batch.metas[0]],
                                       rows_per_tree=rows / 2)
    torch.testing.assert_close(adv_dup[:-1], adv)
    assert torch.all(adv_dup[-1] == 0)


def test_missing_metadata_says_how_to_launch():
    batch = leaf_batch(np.random.default_rng(0), n_trees=1, n_leaves=2)
    with pytest.raises(ValueError, match=r"tree_meta.*python -m verl_bpo.main"):
        compute_bpo_advantage(batch.token_level_rewards, batch.response_mask, index=batch.uids)


def _with(meta: LeafMeta, **changes) -> dict:
    d = meta.to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: _with(m, turn_spans=[list(s) for s in m.turn_spans[:-1]]), "need one span per turn"),
        (lambda m: _with(m, turn_spans=[[0, 10_000]] + [list(s) for s in m.turn_spans[1:]]), "outside the response"),
        (lambda m: _with(m, leaf_mass=0.0), "leaf_mass=0.0 must be > 0"),
        (lambda m: _with(m, leaf_mass=m.leaf_mass * 0.5), "a leaf of that tree is missing"),
        (lambda m: _with(m, tree_id="other-tree"), r"uid 'uid\d' carries tree '.*' and tree '.*'"),
        (lambda m: {k: v for k, v in m.to_dict().items() if k != "node_path"}, r"lacks \['node_path'\]"),
    ],
    ids=["missing-span", "span-outside", "mass-zero", "mass-mismatch", "tree-id-mismatch", "no-path"],
)
def test_bad_metadata_gives_a_clear_error(change, message):
    batch = leaf_batch(np.random.default_rng(5), n_trees=2, n_leaves=4, k0=2)
    metas = [m.to_dict() for m in batch.metas]
    metas[0] = change(batch.metas[0])
    with pytest.raises(ValueError, match=message):
        compute_bpo_advantage(batch.token_level_rewards, batch.response_mask, index=batch.uids, tree_meta=metas)


def test_tree_split_across_two_uids_is_rejected():
    batch = leaf_batch(np.random.default_rng(5), n_trees=1, n_leaves=4, k0=2)
    uids = batch.uids.copy()
    uids[0] = "some-other-uid"
    with pytest.raises(ValueError, match="one tree must be one uid group"):
        compute_bpo_advantage(batch.token_level_rewards, batch.response_mask, index=uids, tree_meta=batch.metas)


def test_padding_copies_are_recognised_whatever_the_row_order():
    """verl's padding copies a row with a zero mask and its metadata; the copy may come before the original."""
    batch = leaf_batch(np.random.default_rng(13), n_trees=2, n_leaves=4)
    adv, _ = run_bpo(batch)
    rewards = torch.cat([batch.token_level_rewards[:1], batch.token_level_rewards])
    mask = torch.cat([torch.zeros_like(batch.response_mask[:1]), batch.response_mask])
    uids = np.concatenate([batch.uids[:1], batch.uids])
    adv_first, _ = compute_bpo_advantage(rewards, mask, index=uids, tree_meta=[batch.metas[0]] + batch.metas,
                                         rows_per_tree=len(batch.metas) / 2)
    torch.testing.assert_close(adv_first[1:], adv)
    assert torch.all(adv_first[0] == 0)


def test_two_live_rows_of_one_leaf_are_rejected():
    batch = leaf_batch(np.random.default_rng(13), n_trees=1, n_leaves=4)
    with pytest.raises(ValueError, match="appears twice"):
        compute_bpo_advantage(torch.cat([batch.token_level_rewards, batch.token_level_rewards[:1]]),
                              torch.cat([batch.response_mask, batch.response_mask[:1]]),
                              index=np.concatenate([batch.uids, batch.uids[:1]]), tree_meta=batch.metas + batch.metas[:1])


def test_what_the_trainer_adds_to_a_rows_reward_is_credited_to_its_last_turn():
    """verl's KL-in-reward penalty (or reward shaping) changes token_level_rewards, not the metadata: the row total
    minus its turn rewards lands on the row's own leaf turn, so BPO optimises the same return GRPO sees."""
    batch = leaf_batch(np.random.default_rng(17), n_trees=2, n_leaves=5, k0=2)
    penalty = torch.zeros_like(batch.token_level_rewards)
    penalty[batch.response_mask.bool()] = -0.01 * torch.rand(int(batch.response_mask.sum()),
                                                             generator=torch.Generator().manual_seed(0))
    adv, _ = run_bpo(batch)
    adv_kl, _ = compute_bpo_advantage(batch.token_level_rewards + penalty, batch.response_mask, index=batch.uids,
                                      tree_meta=batch.metas)
    assert not torch.allclose(adv, adv_kl)
    # The same as metadata whose last turn carries the penalty: an explicit per-turn reward.
    moved = [dataclasses.replace(m, turn_rewards=m.turn_rewards[:-1] + (m.turn_rewards[-1] + float(p.sum()),))
             for m, p in zip(batch.metas, penalty)]
    adv_moved, _ = compute_bpo_advantage(batch.token_level_rewards + penalty, batch.response_mask, index=batch.uids,
                                         tree_meta=moved)
    torch.testing.assert_close(adv_kl, adv_moved)


def test_the_advantage_scale_is_the_batch_rows_per_tree_not_each_trees_leaf_count():
    """Two trees of unequal leaf counts: each row carries s · w · A with one s for the whole batch (rows / trees,
    or what the trainer passes), so verl's fixed-divisor loss weighs both trees equally."""
    small = leaf_batch(np.random.default_rng(19), n_trees=1, n_leaves=3, k0=3, flat=True, per_turn_rewards=False)
    big = leaf_batch(np.random.default_rng(23), n_trees=1, n_leaves=7, k0=7, flat=True, per_turn_rewards=False)
    big_metas = [dataclasses.replace(m, tree_id="big") for m in big.metas]
    width = max(small.response_mask.shape[1], big.response_mask.shape[1])

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    rewards = torch.cat([pad(small.token_level_rewards), pad(big.token_level_rewards)])
    mask = torch.cat([pad(small.response_mask), pad(big.response_mask)])
    uids = np.array(["a"] * 3 + ["b"] * 7, dtype=object)
    adv, _ = compute_bpo_advantage(rewards, mask, index=uids, tree_meta=small.metas + big_metas)
    rloo_small, _ = compute_rloo_outcome_advantage(pad(small.token_level_rewards), pad(small.response_mask),
                                                   index=np.array(["a"] * 3, dtype=object))
    # rows per tree = 10 / 2 = 5; a flat tree's advantage is N · w · A_rloo = A_rloo, times s / N here.
    torch.testing.assert_close(adv[:3], rloo_small * 5 / 3, atol=1e-6, rtol=1e-6)
    adv_8, _ = compute_bpo_advantage(rewards, mask, index=uids, tree_meta=small.metas + big_metas, rows_per_tree=8)
    torch.testing.assert_close(adv_8, adv * 8 / 5)
