"""actor_loss runs verl's own ``ppo_loss``: its value and gradient against the PPO loss written out by hand.

The rows are ragged (a fully masked padding row among them), the old log-probs are off the current ones so that
PPO's clip and dual clip bind on some tokens, and the batch is split over two data-parallel ranks holding unequal
token counts, so a per-rank normaliser where verl uses a global one would show.
"""

from __future__ import annotations

import pytest
import torch

from verl_bpo.integration.actor_loss import actor_loss

ROWS, LENGTH, DP = 8, 6, 2


def batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64).float() * 3
    old_log_prob = log_prob + torch.randn(ROWS, LENGTH, generator=g) * 0.5
    advantages = torch.randn(ROWS, LENGTH, generator=g)
    lengths = torch.tensor([6, 1, 4, 0, 6, 6, 5, 6])  # rank 0 holds 11 tokens, rank 1 holds 23
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    return log_prob, old_log_prob, advantages, mask


def ppo_clip(log_prob, old_log_prob, advantages, clip=0.2, clip_c=3.0):
    """PPO's clipped per-token loss with the dual clip on negative advantages (verl's defaults)."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
    return torch.where(advantages < 0, torch.minimum(clipped, -advantages * clip_c), clipped)


@pytest.mark.parametrize("mode,expected", [
    # the sum over the mini-batch's rows of each row's token sum, / global_batch_size, / loss_scale_factor
    ("seq-mean-token-sum-norm", lambda tokens, mask: (tokens * mask).sum() / (2 * ROWS) / 16),
    # the mean over the mini-batch's tokens, whichever rank holds them
    ("token-mean", lambda tokens, mask: (tokens * mask).sum() / mask.sum()),
])
def test_the_loss_and_its_gradient_are_the_ppo_loss_normalised_over_the_mini_batch(mode, expected):
    log_prob, old_log_prob, advantages, mask = batch()
    ours = log_prob.clone().requires_grad_(True)
    loss = actor_loss(ours, old_log_prob, advantages, mask, loss_agg_mode=mode, global_batch_size=2 * ROWS,
                      loss_scale_factor=16, dp_size=DP)
    loss.backward()
    direct = log_prob.clone().requires_grad_(True)
    tokens = ppo_clip(direct, old_log_prob, advantages)
    clipped = (ppo_clip(log_prob + 1e-3, old_log_prob, advantages) == tokens.detach()) & mask.bool()
    assert clipped.any() and not clipped.all()  # both the clip and the ratio's own gradient are exercised
    reference = expected(tokens, mask)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(ours.grad, direct.grad)
    assert ours.grad[~mask.bool()].abs().max() == 0
