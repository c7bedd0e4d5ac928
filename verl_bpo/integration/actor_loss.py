"""verl's policy loss for one mini-batch, called exactly as verl's actor calls it.

verl's actor (``workers/utils/losses.py``: ``ppo_loss``) sets ``global_batch_info`` (``dp_size``,
``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) on its config and calls the registered policy
loss (``actor.policy_loss.loss_mode``, default ``vanilla``), which aggregates with ``agg_loss``. The in-process
trainer (:mod:`verl_bpo.local`) and the production-path tests use this function, so they normalise as verl does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

__all__ = ["actor_loss"]


@dataclasses.dataclass
class _ActorConfig:
    """The fields of verl's ``ActorConfig`` a policy loss reads."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    global_batch_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def actor_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, *, loss_agg_mode: str, global_batch_size: int,
               loss_scale_factor: int | None, dp_size: int = 1, loss_mode: str = "vanilla",
               clip_ratio: float = 0.2) -> torch.Tensor:
    """The policy loss of one data-parallel rank's share of a mini-batch of ``global_batch_size`` rows."""
    config = _ActorConfig(clip_ratio=clip_ratio, global_batch_info={
        "dp_size": dp_size,
        "batch_num_tokens": int(response_mask.sum().item()) * dp_size,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    })
    loss, _ = get_policy_loss_fn(loss_mode)(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask.bool(),
        loss_agg_mode=loss_agg_mode, config=config,
    )
    return loss
