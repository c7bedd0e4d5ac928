"""Tree rows for the trainer: each tree's leaf rows become one packed row (``bpo.packed``), so verl's actor computes
``old_log_prob``, the reference log-prob and its update over each unique token once.

The leaf rows stay in verl's TransferQueue for everything that reads rows as episodes: rewards, the ``bpo``
estimator, verl's metrics. What the actor workers see is one ordinary verl row per tree
(:mod:`verl_bpo.core.packing`: the prompt, then every unique response token in depth-first order) plus three
per-token fields that describe the tree to the attention (:data:`LAYOUT_FIELDS`, read by
:mod:`verl_bpo.integration.packed_engine`). Values move between the two layouts by copy:

* old and reference log-probs: computed on the packed rows, each leaf token reads its packed token's;
* advantages: computed on the leaf rows (``s · w_leaf · A``, :mod:`~verl_bpo.integration.estimator`), each packed
  token gets the **sum** over its copies, times ``P / R`` (packed rows over leaf rows of the batch), because the
  actor's loss divides by the packed row count ``P`` instead of the leaf rows ``R``: the loss stays exactly
  ``(1/B) Σ_trees Σ_e W_e A_e ∇log π`` (PPO-clip is positively homogeneous in the advantage, and every copy of a
  token has the same ratio and an advantage of the same sign);
* response mask: a packed token is trained when any copy is (a masked copy carries advantage 0);
  rollout log-probs and verl's rollout-correction weights: any copy's (they depend on the token and its context
  only).

A packed row holds one whole tree, so verl's length balancing, its data-parallel split and its micro-batches move
whole trees; with ``use_remove_padding`` verl concatenates a micro-batch's rows into one sequence, which puts several
small trees in one forward.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_bpo.core.leaf_meta import META_KEY, LeafMeta, is_padding_uid
from verl_bpo.core.packing import LeafTokens, PackedTree, pack_tree

__all__ = ["LAYOUT_FIELDS", "PackedBatch", "pack_rows", "packed_advantages", "packed_mask", "packed_fields", "nested",
           "row_arrays", "column"]

# Per-token fields of a packed row (the length of input_ids): the token's segment, its segment's parent segment
# (-1 for the prompt), 1 where the token is a key (0 on bridges). Row-local ids.
LAYOUT_FIELDS = ("bpo_segment", "bpo_segment_parent", "bpo_is_key")
_PAD_PROMPT = 3  # a padding row: 3 prompt tokens and 1 response token, nothing trained


def nested(values: Sequence[np.ndarray | torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A jagged nested tensor of one 1-D tensor per row (how verl stores per-token fields in TransferQueue)."""
    return torch.nested.as_nested_tensor([torch.as_tensor(np.asarray(v)).to(dtype) for v in values],
                                         layout=torch.jagged)


def row_arrays(value: Any) -> list[np.ndarray]:
    """Per row, a 1-D numpy array of a nested (or padded) per-token field."""
    def numpy(t: torch.Tensor) -> np.ndarray:  # bfloat16 (verl's log-probs under autocast) -> float32, exactly
        t = t.detach().cpu()
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()

    if isinstance(value, torch.Tensor) and value.is_nested:
        return [numpy(t) for t in value.unbind()]
    return [numpy(t) for t in value]


def pack_rows(uids: Sequence[Any], extras: Sequence[Any], prompts: Sequence[np.ndarray],
              responses: Sequence[np.ndarray]) -> list[tuple[Any, list[int], PackedTree]]:
    """Per tree of a batch of leaf rows (verl's padding rows left out): its uid, its rows, its packed layout."""
    by_tree: dict[Any, list[int]] = {}
    for i, (uid, extra) in enumerate(zip(uids, extras)):
        if not is_padding_uid(uid):
            if not isinstance(extra, dict) or META_KEY not in extra:
                raise ValueError(f"row {i} (uid {uid!r}) has no tree metadata; bpo.packed needs every row from the "
                                 "bpo_tree agent loop")
            by_tree.setdefault(uid, []).append(i)
    return [(uid, rows, pack_tree([LeafTokens(prompts[i], responses[i], LeafMeta.from_dict(extras[i][META_KEY], i))
                                   for i in rows])) for uid, rows in by_tree.items()]


def packed_advantages(tree: PackedTree, leaf_advantages: Sequence[np.ndarray], scale: float) -> np.ndarray:
    """A packed row's advantages: each token's sum over its copies (their ``s · w_leaf · A``), times ``scale``
    = packed rows / leaf rows of the batch, the ratio of the two layouts' loss normalisers."""
    return scale * tree.sum_copies(leaf_advantages)


def packed_mask(tree: PackedTree, leaf_masks: Sequence[np.ndarray]) -> np.ndarray:
    """A packed token is trained when any copy is (a masked copy carries advantage 0); bridges never are."""
    return tree.sum_copies(leaf_masks) > 0


def packed_fields(tree: PackedTree, *, response_mask: np.ndarray, rollout_log_probs: np.ndarray | None
                  ) -> dict[str, torch.Tensor]:
    """The tensor fields of one packed row, in verl's per-sample form."""
    prompt, response = tree.input_ids[:tree.prompt_len], tree.input_ids[tree.prompt_len:]
    parent_of_token = tree.parent[tree.segment]
    mask = torch.as_tensor(response_mask, dtype=torch.int64)
    fields = {
        "prompts": torch.as_tensor(prompt), "responses": torch.as_tensor(response),
        "input_ids": torch.as_tensor(tree.input_ids), "attention_mask": torch.ones(len(tree.input_ids),
                                                                                    dtype=torch.int64),
        "position_ids": torch.as_tensor(tree.position_ids), "response_mask": mask, "loss_mask": mask.clone(),
        "rm_scores": torch.zeros(len(response), dtype=torch.float32),
        "bpo_segment": torch.as_tensor(tree.segment), "bpo_segment_parent": torch.as_tensor(parent_of_token),
        "bpo_is_key": torch.as_tensor(tree.is_key.astype(np.int64)),
    }
    if rollout_log_probs is not None:
        fields["rollout_log_probs"] = torch.as_tensor(rollout_log_probs, dtype=torch.float32)
    return fields


def _padding_tree(eos: int) -> PackedTree:
    ids = np.full(_PAD_PROMPT + 1, eos, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return PackedTree(_PAD_PROMPT, ids, np.arange(_PAD_PROMPT + 1), np.zeros(_PAD_PROMPT + 1, np.int64),
                      np.array([-1]), np.ones(_PAD_PROMPT + 1, bool), empty, empty, empty)


@dataclasses.dataclass
class PackedBatch:
    """One step's packed rows in TransferQueue, beside the leaf rows they were built from.

    Attributes:
        leaf_batch: the leaf rows (verl's batch).
        meta: the packed rows (one per tree, then padding rows up to a multiple of ``dp_size``), what the actor
            workers get; verl may reorder it (length balancing).
        trees: per tree, its packed layout; ``leaf_index[t]`` the tree's leaf rows (indices into ``leaf_batch``)
            in the order given to :func:`pack_tree`, ``leaf_lens[t]`` their response lengths.
        packed_key: per tree, the key of its packed row.
        base_info: the call settings every stage on the packed rows starts from (the leaf batch's, and verl's
            dynamic batch size by tokens).
    """

    leaf_batch: KVBatchMeta
    meta: KVBatchMeta
    trees: list[PackedTree]
    leaf_index: list[list[int]]
    leaf_lens: list[list[int]]
    packed_key: list[str]
    base_info: dict[str, Any]

    @classmethod
    def build(cls, leaf_batch: KVBatchMeta, dp_size: int, eos_token_id: int, max_token_len: int) -> PackedBatch:
        """Pack every tree of ``leaf_batch`` and put the packed rows into TransferQueue (same partition).

        verl cuts the packed rows into micro-batches by tokens (its dynamic batch size), ``max_token_len`` per
        micro-batch (or the longest tree, if longer): a tree's row holds several leaves' worth of tokens, so a row
        count sized for leaf rows says nothing about its memory."""
        part = leaf_batch.partition_id
        data = tq.kv_batch_get(keys=leaf_batch.keys, partition_id=part)
        uids, extras = column(data, "uid"), column(data, "extra_fields")
        prompts, responses = row_arrays(data["prompts"]), row_arrays(data["responses"])
        masks = row_arrays(data["response_mask"])
        logps = row_arrays(data["rollout_log_probs"]) if "rollout_log_probs" in data.keys() else None

        trees, keys, samples, tags, leaf_index, leaf_lens = [], [], [], [], [], []
        grouped = pack_rows(uids, extras, prompts, responses)
        for uid, rows, tree in grouped:
            mask = packed_mask(tree, [masks[i] for i in rows])
            rollout = None if logps is None else tree.any_copy([logps[i] for i in rows])
            sample = _template(data[rows[0]])
            sample.update(packed_fields(tree, response_mask=mask, rollout_log_probs=rollout))
            sample["extra_fields"] = {"bpo_packed_leaves": len(rows)}
            tag = copy.deepcopy(leaf_batch.tags[rows[0]])
            tag.update(prompt_len=tree.prompt_len, response_len=tree.response_len, seq_len=len(tree.input_ids))
            trees.append(tree)
            keys.append(f"{uid}_bpo_packed")
            samples.append(sample)
            tags.append(tag)
            leaf_index.append(rows)
            leaf_lens.append([len(responses[i]) for i in rows])
        pad_uid = f"pad{uuid.uuid4().hex}"
        for j in range(-len(samples) % dp_size):
            sample = _template(data[grouped[0][1][0]])
            pad = _padding_tree(eos_token_id)
            sample.update(packed_fields(pad, response_mask=np.zeros(1, np.int64),
                                        rollout_log_probs=None if logps is None else np.zeros(1)))
            sample.update(uid=pad_uid, extra_fields={})
            tag = copy.deepcopy(tags[0])
            tag.update(is_padding=True, prompt_len=_PAD_PROMPT, response_len=1, seq_len=_PAD_PROMPT + 1)
            keys.append(f"{pad_uid}_{j}_bpo_packed")
            samples.append(sample)
            tags.append(tag)
        tq.kv_batch_put(keys=keys, partition_id=part, fields=list_of_dict_to_tensordict(samples), tags=tags)
        extra_info = dict(leaf_batch.extra_info or {})
        extra_info.update(use_dynamic_bsz=True,
                          max_token_len_per_gpu=max(max_token_len, *(len(t.input_ids) for t in trees)))
        meta = KVBatchMeta(keys=keys, tags=tags, partition_id=part, extra_info=dict(extra_info))
        return cls(leaf_batch, meta, trees, leaf_index, leaf_lens, keys[:len(trees)], extra_info)

    def fresh_meta(self) -> KVBatchMeta:
        """The packed rows' meta with only the packing's own call settings: each of verl's stages adds its own
        (``compute_loss``, ``calculate_entropy``, ...) to the meta it is handed and must not inherit another's."""
        self.meta.extra_info = dict(self.base_info)
        return self.meta

    @property
    def leaf_rows(self) -> int:
        return len(self.leaf_batch.keys)

    def metrics(self) -> dict[str, float]:
        """Trained tokens per tree, packed and as the leaf layout would train them."""
        if not self.trees:
            return {}
        packed = [len(t.input_ids) for t in self.trees]
        leaf = [len(rows) * t.prompt_len + sum(lens) for t, rows, lens in
                zip(self.trees, self.leaf_index, self.leaf_lens)]
        return {"bpo/trained_tokens": float(np.mean(packed)), "bpo/trained_tokens_leaf_layout": float(np.mean(leaf)),
                "bpo/trained_tokens_packed_over_leaf": float(np.sum(packed) / np.sum(leaf))}

    def to_leaves(self, field: str) -> None:
        """Copy a per-response-token field (old or reference log-probs) from the packed rows onto the leaf rows."""
        data = tq.kv_batch_get(keys=self.packed_key, partition_id=self.meta.partition_id, select_fields=[field])
        dtype = data[field].dtype
        packed = row_arrays(data[field])
        keys, values = [], []
        for tree, rows, lens, value in zip(self.trees, self.leaf_index, self.leaf_lens, packed):
            keys.extend(self.leaf_batch.keys[i] for i in rows)
            values.extend(tree.to_leaves(value, lens))
        tq.kv_batch_put(keys=keys, partition_id=self.meta.partition_id,
                        fields=_fields({field: nested(values, dtype)}, len(keys)))

    def from_leaves(self) -> None:
        """Put the leaf rows' advantages (summed over copies, times P / R), response mask and rollout-correction
        weights (if any) onto the packed rows."""
        part = self.meta.partition_id
        data = tq.kv_batch_get(keys=self.leaf_batch.keys, partition_id=part)
        columns = {name: row_arrays(data[name]) for name in ("advantages", "response_mask", "rollout_is_weights")
                   if name in data.keys()}
        scale = len(self.meta.keys) / self.leaf_rows
        out: dict[str, list[np.ndarray]] = {name: [] for name in columns}
        for tree, rows in zip(self.trees, self.leaf_index):
            out["advantages"].append(packed_advantages(tree, [columns["advantages"][i] for i in rows], scale))
            out["response_mask"].append(packed_mask(tree, [columns["response_mask"][i] for i in rows]))
            if "rollout_is_weights" in columns:
                out["rollout_is_weights"].append(tree.any_copy([columns["rollout_is_weights"][i] for i in rows], 1.0))
        dtypes = {"advantages": torch.float32, "response_mask": torch.int64, "rollout_is_weights": torch.float32}
        tq.kv_batch_put(keys=self.packed_key, partition_id=part,
                        fields=_fields({n: nested(v, dtypes[n]) for n, v in out.items()}, len(self.packed_key)))
        pads = self.meta.keys[len(self.trees):]
        if pads:
            zero = {"advantages": nested([np.zeros(1)] * len(pads), torch.float32)}
            tq.kv_batch_put(keys=pads, partition_id=part, fields=_fields(zero, len(pads)))

    def clear(self) -> None:
        tq.kv_clear(keys=self.meta.keys, partition_id=self.meta.partition_id)


def _template(sample: Any) -> dict[str, Any]:
    """A packed row's non-token fields, copied from one of its tree's leaf rows (as verl's padding does)."""
    out = {}
    for key in sample.keys():
        value = sample[key]
        out[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    for key in ("routed_experts", "teacher_ids", "teacher_logprobs", "multi_modal_inputs"):
        out.pop(key, None)
    return out


def _fields(columns: dict[str, torch.Tensor], rows: int) -> TensorDict:
    return TensorDict(columns, batch_size=rows)


def column(data: Any, key: str) -> list[Any]:
    """A non-tensor TensorDict column as a plain list (``.get`` gives a NonTensorStack, ``[]`` a LinkedList)."""
    value = data.get(key)
    return value.tolist() if hasattr(value, "tolist") else list(value)
