"""verl's actor loss for one mini-batch: verl's own ``ppo_loss`` on verl's own actor config.

The in-process trainer (:mod:`verl_bpo.local`) and the production-path tests use :func:`actor_loss`, so their
gradients are normalised by the code verl's actor runs, not by a copy of it:

* the config is verl's ``FSDPActorConfig``, built by ``omega_conf_to_dataclass`` (as ``engine_workers`` builds it)
  from the ``actor_rollout_ref.actor`` section of verl's flattened ``ppo_trainer`` config;
* each rank's rows are the nested fields verl's v1 trainer stores (``prompts``, ``responses``, ``response_mask``,
  ``loss_mask``, ``old_log_probs``, ``advantages``), with ``global_batch_size`` in the data as the trainer's
  ``_update_actor`` puts it;
* each rank's loss is ``verl.workers.utils.losses.ppo_loss`` (which sets ``config.global_batch_info`` and calls the
  registered policy loss and ``agg_loss``), given the log-probs as the engine's ``prepare_model_outputs`` gives
  them: one nested row per sequence, position p holding the log-prob of token p + 1.

Imitated, because verl computes them inside its FSDP engine with a process group (one per rank, which one process
cannot be): ``dp_size`` and ``batch_num_tokens`` (the all-reduced sum of the ranks' ``loss_mask``), set as
``FSDPEngine.forward_backward_batch`` sets them (verl/workers/engine/fsdp/transformer_impl.py), and the mean of the
ranks' losses, which has the gradient DDP/FSDP's gradient averaging applies. Each rank runs its rows as one
micro-batch: ``ppo_loss`` normalises by the global quantities above, so the engine's micro-batch split does not
change the sum. The split over ranks is the one verl's dispatch makes (``BatchData.chunk``: equal contiguous
chunks), done by slicing: ``chunk_tensordict`` re-nests every row, which would triple the cost of a call.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from omegaconf import OmegaConf
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

from verl_bpo.integration.stock_launch import verl_defaults

__all__ = ["actor_loss"]


@lru_cache(maxsize=None)
def _actor_config(loss_agg_mode: str, loss_scale_factor: int | None) -> ActorConfig:
    """verl's actor config with verl's defaults but for the loss aggregation; one object per setting, as a worker
    holds one (``ppo_loss`` rewrites its ``global_batch_info`` on every call, as on a worker)."""
    actor = {"loss_agg_mode": loss_agg_mode, "loss_scale_factor": loss_scale_factor,
             # as recipes/common.sh runs the actor; verl requires either this or a micro-batch size
             "use_dynamic_bsz": True}
    config = OmegaConf.merge(verl_defaults(), {"actor_rollout_ref": {"actor": actor}})
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _nested(padded: torch.Tensor) -> torch.Tensor:
    """Rows of equal length as a jagged nested tensor, the layout of verl's stored fields and model outputs."""
    rows, length = padded.shape
    # With the row length given: torch's to_padded_tensor otherwise pads these rows to the total length.
    return torch.nested.nested_tensor_from_jagged(padded.reshape(-1).contiguous(),
                                                  offsets=torch.arange(rows + 1) * length,
                                                  min_seqlen=length, max_seqlen=length)


def actor_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, *, loss_agg_mode: str, global_batch_size: int,
               loss_scale_factor: int | None, dp_size: int = 1) -> torch.Tensor:
    """The loss of one mini-batch of ``(rows, length)`` response tokens over ``dp_size`` ranks, whose gradient is
    the one verl's actor applies: the mean over ranks of verl's ``ppo_loss`` on each rank's share.

    ``global_batch_size`` is what verl's trainer puts in the data (``ppo_mini_batch_size · rollout.n``, which the
    BPO trainer sets to the mini-batch's rows). Each row is one sequence of a one-token prompt and a response of
    the full ``length`` (its padding masked out): ``ppo_loss`` reads ``prompts`` and ``responses`` only for their
    lengths, to cut the response out of the model output (verl/workers/utils/padding.py: no_padding_2_padding).
    """
    rows, length = response_mask.shape
    if rows % dp_size:
        raise ValueError(f"{rows} rows do not split over {dp_size} data-parallel ranks")
    config = _actor_config(loss_agg_mode, loss_scale_factor)
    # FSDPEngine.forward_backward_batch: all_reduce(loss_mask.sum()) over the data-parallel group, and its size.
    engine = {"batch_num_tokens": response_mask.sum().item(), "dp_size": dp_size}
    # The model output an engine computes: the sequence's log-probs shifted by one (position p predicts p + 1), so
    # the prompt's one position holds the first response token's and the last position is unused.
    model_log_probs = torch.cat([log_prob, log_prob.new_zeros(rows, 1)], dim=1)
    loss = 0.0
    # verl's dispatch (single_controller/base/decorator.py) gives rank r the r-th of dp_size equal chunks.
    per_rank = rows // dp_size
    ids = torch.zeros(per_rank, length, dtype=torch.int64)
    for rank in range(dp_size):
        share = slice(rank * per_rank, (rank + 1) * per_rank)
        fields = {"prompts": ids[:, :1], "responses": ids, "response_mask": response_mask[share],
                  "loss_mask": response_mask[share], "old_log_probs": old_log_prob[share].detach(),
                  "advantages": advantages[share].detach()}
        data = tu.get_tensordict({k: _nested(v) for k, v in fields.items()},
                                 non_tensor_dict={"global_batch_size": global_batch_size, **engine})
        model_output = {"log_probs": _nested(model_log_probs[share])}
        loss = loss + ppo_loss(config, model_output, data)[0]
    return loss / dp_size
