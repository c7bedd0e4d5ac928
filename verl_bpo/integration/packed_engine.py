"""verl's FSDP language-model engine, taught to read packed tree rows (``bpo.packed``).

A packed row (:mod:`verl_bpo.integration.packed_rows`) is an ordinary verl row whose position ids are path
positions and whose three layout fields describe the tree. verl's engine already does everything else: it builds
the inputs (padded rows, or one remove-padding sequence per micro-batch), reads each response token's log-prob from
the logits before it (bridges make that the right logits), applies its loss, FSDP, optimizer, clipping and
checkpoints. The one thing it cannot do is attend along a tree, so :class:`FSDPEngineWithPackedTrees` builds the
micro-batch's :class:`~verl_bpo.integration.tree_attention.TreeAttentionPlan` (over the flat positions of the
model's input, either layout) and makes it active around verl's own ``forward_step``; micro-batches without the
layout fields (every other run, the critic, validation) take verl's path unchanged.

:func:`install` runs in every Ray process of a BPO run (the plugin imports it where the BPO trainer is wanted): it
wraps transformers' attention functions (pass-through unless a plan is active) and puts this engine in place of
verl's ``FSDPEngineWithLMHead`` in verl's engine registry, for every device and backend it was registered under.
"""

from __future__ import annotations

import numpy as np
import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from verl_bpo.integration import tree_attention
from verl_bpo.integration.packed_rows import LAYOUT_FIELDS, row_arrays

__all__ = ["FSDPEngineWithPackedTrees", "micro_batch_plan", "install"]


def micro_batch_plan(micro_batch, *, padded: bool, extra_positions: int = 0,
                     device: torch.device | None = None) -> tree_attention.TreeAttentionPlan:
    """The tree attention plan of a micro-batch of packed rows, over the flat positions verl feeds the model:
    row b's token t at ``b · T_max + t`` (padded rows) or at the row's offset in the concatenated sequence (remove
    padding, followed by ``extra_positions`` of verl's static padding)."""
    seg_rows, par_rows, key_rows = (row_arrays(micro_batch[f]) for f in LAYOUT_FIELDS)
    lengths = [len(s) for s in seg_rows]
    if padded:
        width = max(lengths)
        starts = [b * width for b in range(len(lengths))]
        total = width * len(lengths)
    else:
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        total = sum(lengths) + extra_positions
    segment = np.full(total, -1, dtype=np.int64)
    is_key = np.zeros(total, dtype=bool)
    parents, offset = [], 0
    for start, seg, par, key in zip(starts, seg_rows, par_rows, key_rows):
        count = int(seg.max()) + 1
        parent = np.full(count, -1, dtype=np.int64)
        parent[seg] = par  # every token of a segment carries its segment's parent
        parents.append(np.where(parent >= 0, parent + offset, -1))
        segment[start:start + len(seg)] = seg + offset
        is_key[start:start + len(seg)] = key.astype(bool)
        offset += count
    return tree_attention.TreeAttentionPlan.build(
        torch.from_numpy(segment), torch.from_numpy(np.concatenate(parents)), torch.from_numpy(is_key),
        device=device)


class FSDPEngineWithPackedTrees(FSDPEngineWithLMHead):
    """verl's FSDP engine; a micro-batch of packed tree rows runs under its tree attention plan, which stays active
    through the micro-batch's backward (verl runs it after ``forward_step`` returns; gradient checkpointing
    recomputes the forward in it)."""

    _set_plan = None  # inside forward_backward_batch of a packed batch: makes a micro-batch's plan active

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if LAYOUT_FIELDS[0] not in data.keys():
            return super().forward_backward_batch(data, loss_function, forward_only)
        with tree_attention.plan_slot() as self._set_plan:
            try:
                return super().forward_backward_batch(data, loss_function, forward_only)
            finally:
                self._set_plan = None

    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._set_plan is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        micro_batch = micro_batch.to(get_device_id())
        padded = not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        extra = 0
        if not padded:
            extra = self._get_packed_pad_size(int(micro_batch["input_ids"].offsets()[-1]))
        self._set_plan(micro_batch_plan(micro_batch, padded=padded, extra_positions=extra,
                                        device=micro_batch["input_ids"].device))
        return super().forward_step(micro_batch, loss_function, forward_only)


def install() -> None:
    """Tree-aware attention functions, and this engine wherever verl registered its FSDP language-model engine."""
    tree_attention.install()
    for by_device in EngineRegistry._engines.get("language_model", {}).values():
        for key, engine in list(by_device.items()):
            if engine is FSDPEngineWithLMHead:
                by_device[key] = FSDPEngineWithPackedTrees
