"""The trainer side of packed trees (verl_bpo/integration/packed_rows.py): ``PackedBatch`` builds one packed row per
tree from the leaf rows in TransferQueue, pads to the data-parallel ranks, copies log-probs back to the leaf rows and
sums the leaf advantages onto the packed rows.

TransferQueue needs Ray, so these tests run against ``FakeTransferQueue``, an in-memory stand-in with the three
calls ``PackedBatch`` makes; the real queue carries packed rows in the end-to-end runs
(tests/e2e/test_bpo_trainer.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from tests.test_packing import PROMPT, leaf
from verl_bpo.core.leaf_meta import LeafMeta
from verl_bpo.core.packing import LeafTokens, pack_tree
from verl_bpo.integration import packed_rows
from verl_bpo.integration.packed_rows import LAYOUT_FIELDS, PackedBatch

PART = "train"


class FakeTransferQueue:
    """In-memory rows by key: ``kv_batch_get`` / ``kv_batch_put`` / ``kv_clear`` as ``PackedBatch`` calls them."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def kv_batch_put(self, keys, partition_id, fields: TensorDict, tags=None):
        for i, key in enumerate(keys):
            row = fields[i]
            self.rows.setdefault(key, {}).update({name: row[name] for name in row.keys()})

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        common = set.intersection(*(set(self.rows[key]) for key in keys))  # fields every row has
        names = [k for k in self.rows[keys[0]] if k in common and (select_fields is None or k in select_fields)]
        return list_of_dict_to_tensordict([{k: self.rows[key][k] for k in names} for key in keys])

    def kv_clear(self, keys, partition_id):
        for key in keys:
            self.rows.pop(key, None)


def trees():
    """Three trees of leaf rows (forks at two depths, observations, an early end), uid per tree."""
    t0 = [leaf("t0", 0, PROMPT, ["ab|xy", "cd|z"], nodes=[0, 1, 2], mass=0.25),
          leaf("t0", 1, PROMPT, ["ab|xy", "ef"], nodes=[0, 1, 3], mass=0.25),
          leaf("t0", 2, PROMPT, ["gh|w"], nodes=[0, 4], mass=0.5)]
    t1 = [leaf("t1", 0, PROMPT, ["i|q", "j"], nodes=[0, 1, 2], mass=0.5),
          leaf("t1", 1, PROMPT, ["k|r"], nodes=[0, 3], mass=0.5)]
    t2 = [leaf("t2", 0, PROMPT, ["mn|o"], nodes=[0, 1], mass=0.5),
          leaf("t2", 1, PROMPT, ["pq|o"], nodes=[0, 2], mass=0.5)]
    return {"uid0": t0, "uid1": t1, "uid2": t2}


@pytest.fixture
def queue(monkeypatch):
    fake = FakeTransferQueue()
    monkeypatch.setattr(packed_rows, "tq", fake)
    return fake


def batch_order(by_uid: dict[str, list[LeafTokens]]) -> list[tuple[str, LeafTokens]]:
    """The leaf rows interleaved across trees: a tree's rows need not be adjacent in verl's batch."""
    order = [(uid, lf) for uid, leaves in by_uid.items() for lf in leaves]
    return order[::2] + order[1::2]


def tree_id(packed_key: str) -> str:
    return {"uid0": "t0", "uid1": "t1", "uid2": "t2"}[packed_key.split("_")[0]]


def put_leaf_batch(queue: FakeTransferQueue, by_uid: dict[str, list[LeafTokens]]) -> KVBatchMeta:
    """The leaf rows as the agent loop hands them to verl, plus one verl padding row."""
    keys, rows, tags = [], [], []
    for i, (uid, lf) in enumerate(batch_order(by_uid)):
        n = len(lf.response)
        mask = (lf.response >= ord("a")).astype(np.int64)  # generated tokens (lower case) are trained
        ids = np.concatenate([lf.prompt, lf.response])
        rows.append({"uid": uid, "extra_fields": {"bpo": lf.meta.to_dict()}, "prompts": torch.as_tensor(lf.prompt),
                     "responses": torch.as_tensor(lf.response), "response_mask": torch.as_tensor(mask),
                     "loss_mask": torch.as_tensor(mask), "input_ids": torch.as_tensor(ids),
                     "attention_mask": torch.ones(len(ids), dtype=torch.int64),
                     "position_ids": torch.arange(len(ids)), "rm_scores": torch.zeros(n),
                     # the same rollout log-prob on every copy of a token: a function of the token and position
                     "rollout_log_probs": torch.as_tensor(-(lf.response % 7 + np.arange(n)) / 10.0,
                                                          dtype=torch.float32)})
        keys.append(f"{uid}_{i}_0")
        tags.append({"seq_len": len(ids), "prompt_len": len(lf.prompt), "response_len": n})
    zero = torch.zeros(1, dtype=torch.int64)  # verl's padding row: a copy of row 0 with a 1-token empty response
    rows.append({**rows[0], "uid": "pad0", "responses": zero, "response_mask": zero, "loss_mask": zero,
                 "rm_scores": torch.zeros(1), "rollout_log_probs": torch.zeros(1)})
    keys.append("pad0_0_0")
    tags.append({"seq_len": 4, "is_padding": True})
    for key, row in zip(keys, rows):
        queue.rows[key] = row
    return KVBatchMeta(keys=keys, tags=tags, partition_id=PART, extra_info={"temperature": 1.0})


def test_one_packed_row_per_tree_padded_to_the_ranks(queue):
    by_uid = trees()
    leaf_batch = put_leaf_batch(queue, by_uid)
    packed = PackedBatch.build(leaf_batch, dp_size=2, eos_token_id=0, max_token_len=8)
    assert len(packed.meta.keys) == 4 and packed.meta.tags[-1]["is_padding"]  # 3 trees + 1 row for 2 ranks
    assert packed.meta.extra_info["use_dynamic_bsz"] is True
    longest = max(len(t.input_ids) for t in packed.trees)
    assert packed.meta.extra_info["max_token_len_per_gpu"] == longest  # the budget of 8 is below one tree
    leaf_of_key = {k: lf for k, (_, lf) in zip(leaf_batch.keys, batch_order(by_uid))}
    for key, tree, rows in zip(packed.packed_key, packed.trees, packed.leaf_index):
        assert {leaf_of_key[leaf_batch.keys[i]].meta.tree_id for i in rows} == {tree_id(key)}
        expected = pack_tree([leaf_of_key[leaf_batch.keys[i]] for i in rows])  # the tree's rows in batch order
        row = queue.rows[key]
        assert np.array_equal(row["input_ids"].numpy(), expected.input_ids)
        assert np.array_equal(row["position_ids"].numpy(), expected.position_ids)
        assert np.array_equal(row["bpo_segment"].numpy(), expected.segment)
        assert len(row["responses"]) == len(row["response_mask"]) == len(row["rollout_log_probs"])
        assert all(len(row[f]) == len(row["input_ids"]) for f in LAYOUT_FIELDS)
        # trained: generated tokens only (bridges and observations never)
        mask = row["response_mask"].numpy().astype(bool)
        assert np.array_equal(mask, (tree.input_ids[tree.prompt_len:] >= ord("a")) & ~tree.is_bridge)
    pad = queue.rows[packed.meta.keys[-1]]
    assert pad["uid"].startswith("pad") and pad["response_mask"].sum() == 0
    metrics = packed.metrics()
    assert metrics["bpo/trained_tokens_packed_over_leaf"] < 0.8


def test_log_probs_go_back_to_every_copy_and_advantages_sum_onto_the_packed_rows(queue):
    by_uid = trees()
    leaf_batch = put_leaf_batch(queue, by_uid)
    packed = PackedBatch.build(leaf_batch, dp_size=1, eos_token_id=0, max_token_len=64)
    rng = np.random.default_rng(1)
    # old log-probs on the packed rows -> every leaf row
    values = [rng.normal(size=t.response_len) for t in packed.trees]
    queue.kv_batch_put(packed.packed_key, PART, TensorDict(
        {"old_log_probs": packed_rows.nested(values, torch.float32)}, batch_size=len(values)))
    packed.to_leaves("old_log_probs")
    for tree, rows, value in zip(packed.trees, packed.leaf_index, values):
        for j, i in enumerate(rows):
            sel = tree.copy_leaf == j
            got = queue.rows[leaf_batch.keys[i]]["old_log_probs"].numpy()
            np.testing.assert_allclose(got[tree.copy_src[sel]], value[tree.copy_dst[sel]].astype(np.float32))
    # leaf advantages (s * w_leaf * A of each turn's node, 0 where masked) -> summed per packed token, x P / R
    for key in leaf_batch.keys:
        row = queue.rows[key]
        meta = None if key.startswith("pad") else LeafMeta.from_dict(row["extra_fields"]["bpo"])
        adv = np.zeros(len(row["responses"]))
        if meta is not None:
            for (s, _), node in zip(meta.turn_spans, meta.node_path[1:]):
                adv[s:] = meta.leaf_mass * (node - 2.5)  # per node, either sign
        row["advantages"] = torch.as_tensor(adv * row["response_mask"].numpy(), dtype=torch.float32)
    packed.from_leaves()
    scale = len(packed.meta.keys) / len(leaf_batch.keys)
    for tree, rows, key in zip(packed.trees, packed.leaf_index, packed.packed_key):
        leaf_adv = [queue.rows[leaf_batch.keys[i]]["advantages"].numpy().astype(float) for i in rows]
        expected = scale * tree.sum_copies(leaf_adv)
        np.testing.assert_allclose(queue.rows[key]["advantages"].numpy(), expected, rtol=1e-6, atol=1e-7)
        assert np.all(queue.rows[key]["advantages"].numpy()[tree.is_bridge] == 0)
    # every stage starts from the packing's own call settings, then the batch is cleared
    packed.meta.extra_info["compute_loss"] = False
    assert "compute_loss" not in packed.fresh_meta().extra_info
    packed.clear()
    assert not any(k in queue.rows for k in packed.meta.keys)
