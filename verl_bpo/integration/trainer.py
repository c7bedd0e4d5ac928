"""verl glue: the sync trainer that hands tree metadata to the ``bpo`` estimator, and its TaskRunner.

``BPOTrainer`` is verl's own ``PPOTrainerSync`` (``trainer_mode=sync``, unchanged semantics). It always logs the
per-tree ``bpo/...`` metrics the agent loop returns, and it holds the run's one learned allocation state, a
:class:`~verl_bpo.core.fork_policy.ForkPolicy`:

* before each step's rollout it hands every training row the policy's state for that row's task (the profile, the
  warm-up count, the quantile thresholds, the task's episode cost) and the sessions verl runs per task, so every
  agent-loop worker on every node plans on the same state (validation rows get none: validation plays independent
  episodes and never reads or feeds it);
* after the rollout it learns from every tree of the step, in batch order, from the records the trees' first leaves
  carry, and logs the state once (``bpo/profile/...``);
* it saves the state in verl's checkpoint (``global_step_<n>/bpo_allocation.json``) and restores it on resume, so a
  resumed run continues its warm-up and profile where it stopped;
* it stops the run with an error naming the sandbox when most trees of a step never started (a dataset or sandbox
  fault, not a transient one: training on their zero advantages would be silent);
* with ``bpo.tree_log`` it appends a JSON line per step: the step's first tree, and what every tree of the step
  spent on which task (for any estimator: a GRPO run's flat groups are logged the same way).

A training row's ``extra_info.bpo_budget`` reaches the agent loop with the row (verl hands every row's fields to its
sessions), where it replaces the learned root budget of the row's tree (``agent_loop.row_budget``); the sessions
per task stay the leaf cap, which bounds a tree's leaves whatever its budget.

For ``algorithm.adv_estimator=bpo`` it also:

* gives each task ``bpo.learned.max_leaves`` agent-loop sessions when its tree's budget is turns or tokens (verl's
  ``__rollout_n__``: such a tree may grow more leaves than ``rollout.n``, one per session);
* runs verl's advantage code inside :func:`~verl_bpo.integration.estimator.tree_call_context`, so the registered
  estimator sees each row's tree metadata and the batch's rows per tree;
* pads the batch so it splits into ``train_batch_size / ppo_mini_batch_size`` equal mini-batches, and gives the
  actor the rows of one mini-batch as its loss normalizer (:mod:`~verl_bpo.integration.batch_layout`): a tree
  batch has as many rows as its trees have leaves, not ``ppo_mini_batch_size · rollout.n``;
* with ``bpo.packed`` (the default) hands the actor one packed row per tree instead of its leaf rows
  (:mod:`~verl_bpo.integration.packed_rows`): ``old_log_prob``, the reference log-prob and the update run on the
  packed rows, and the leaf rows keep everything that reads episodes (rewards, the estimator, metrics).

With every tree holding ``rollout.n`` leaves all three are verl's own values. Every other estimator runs verl's
code unchanged. ``BPOTaskRunner`` is verl's ``TaskRunnerV1.run`` with this trainer class (the
``run_ppo(config, task_runner_class=...)`` hook verl provides for recipes).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from pprint import pprint
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, PPOTrainerSync, register_trainer
from verl.utils import tensordict_utils as tu
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.logging_utils import configure_verl_logging

from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.core.leaf_meta import META_KEY, is_padding_uid
from verl_bpo.core.profile import TreeRecord
from verl_bpo.integration.agent_loop import STATE_KEY, TREE_METRICS_KEY, TREE_RECORD_KEY, TREE_TASK_KEY, row_task
from verl_bpo.integration.batch_layout import batch_multiple, minibatch_rows, rows_per_tree
from verl_bpo.integration.estimator import ESTIMATOR_NAME, tree_call_context
from verl_bpo.integration.packed_rows import PackedBatch, column
from verl_bpo.integration.settings import read_bpo_config

__all__ = ["BPOTrainer", "BPOTaskRunner", "TRAINER_MODE", "STATE_FILE", "batch_tree_metrics", "rollout_states",
           "learn_from_batch", "check_reset_failures", "save_allocation_state", "load_allocation_state",
           "batch_tree_call", "append_tree", "tree_spend", "column"]

# BPOTrainer's name in verl's trainer registry: verl's stock TaskRunner builds the trainer that
# ``trainer.v1.trainer_mode`` names, so ``trainer_mode=bpo`` runs BPO through ``python -m verl.trainer.main_ppo``.
logger = logging.getLogger(__name__)

TRAINER_MODE = "bpo"
STATE_FILE = "bpo_allocation.json"  # the learned allocation state, in each verl checkpoint folder
RESET_FAILURE_LIMIT = 0.5  # a step where more trees than this never started stops the run


def batch_tree_metrics(uids: list[Any], extra_fields: list[Any]) -> dict[str, float]:
    """Mean of every per-tree ``bpo/...`` metric over the trees of a batch, plus leaf-level failure rates."""
    sums: dict[str, float] = collections.defaultdict(float)
    trees = leaves = failed = 0
    for uid, extra in zip(uids, extra_fields):
        if is_padding_uid(uid) or not isinstance(extra, dict) or META_KEY not in extra:
            continue
        leaves += 1
        failed += bool(extra[META_KEY].get("failed"))
        if TREE_METRICS_KEY in extra:
            trees += 1
            for name, value in extra[TREE_METRICS_KEY].items():
                sums[name] += float(value)
    out = {name: total / trees for name, total in sums.items()} if trees else {}
    if leaves:
        out["bpo/failed_leaf_rate"] = failed / leaves
    return out


def rollout_states(policy: ForkPolicy, sessions: int, extra_infos: list[Any],
                   default_sandbox: Mapping[str, Any]) -> list[str]:
    """What each training row of a step carries to the agent loop (``STATE_KEY``, one JSON string per row): the run's
    allocation state with the cost of the row's own task only (``extra_infos``: the rows' ``extra_info``), and the
    sessions verl runs per task. verl stores a row's fields with each of its outputs, so a row carries no more than
    its own tree needs (a few kB: the profile is a few numbers per depth)."""
    shared = policy.state_dict(task_keys=())  # the same for every row: built once per step
    states = []
    for extra in extra_infos:
        costs = {}
        with contextlib.suppress(ValueError, TypeError, KeyError):  # a row another agent loop runs: no task cost
            key = row_task(extra, default_sandbox).key
            if key in policy.task_costs:
                costs[key] = policy.task_costs[key]
        states.append(json.dumps({"policy": {**shared, "task_costs": costs}, "sessions": sessions}))
    return states


def learn_from_batch(policy: ForkPolicy, uids: list[Any], extra_fields: list[Any]) -> int:
    """The run's policy learns from every tree of a batch, in batch order (each tree's first leaf carries its
    record), whichever worker grew it; returns the trees learned from."""
    records = [TreeRecord.from_dict(e[TREE_RECORD_KEY]) for u, e in zip(uids, extra_fields)
               if not is_padding_uid(u) and isinstance(e, dict) and TREE_RECORD_KEY in e]
    for record in records:
        policy.learn(record)
    return len(records)


def check_reset_failures(uids: list[Any], extra_fields: list[Any], limit: float = RESET_FAILURE_LIMIT) -> None:
    """Stop the run when more than ``limit`` of a step's trees never started: a dataset row or sandbox that cannot
    start is not transient, and its trees would train on zero advantages without a word."""
    failed: list[str] = []
    trees = 0
    for uid, extra in zip(uids, extra_fields):
        if is_padding_uid(uid) or not isinstance(extra, dict) or TREE_METRICS_KEY not in extra:
            continue
        trees += 1
        if extra[TREE_METRICS_KEY].get("bpo/reset_failures"):
            failed.append(str(extra.get("bpo_leaf", {}).get("error")))
    if trees and len(failed) > limit * trees:
        common = collections.Counter(failed).most_common(1)[0][0]
        raise RuntimeError(
            f"{len(failed)} of this step's {trees} trees never started: their sandbox reset failed twice (most "
            f"often: {common}). Check the dataset rows' extra_info.sandbox and extra_info.task (verl_bpo.data "
            "writes valid rows) and that the sandbox's engine runs on every node")


def append_tree(path: str, step: int, uids: list[Any], extra_fields: list[Any]) -> None:
    """Append one JSON line per step: the batch's first tree (every leaf's metadata and outcome, the tree's metrics)
    and, under ``trees``, the spend of every tree of the step in batch order: ``uid``, ``task`` (the row's
    ``extra_info.task``), ``generated_tokens``, ``env_steps``, and ``budget`` for a budgeted (learned) tree. A flat
    group (GRPO's, RLOO's) is one tree: its spend is the group's."""
    heads = [(u, e) for u, e in zip(uids, extra_fields)
             if not is_padding_uid(u) and isinstance(e, dict) and TREE_METRICS_KEY in e]
    if not heads:
        return
    first = heads[0][0]
    rows = [e for u, e in zip(uids, extra_fields) if u == first and isinstance(e, dict) and META_KEY in e]
    line = {"step": step, "uid": first, "leaves": [{"meta": e[META_KEY], **e.get("bpo_leaf", {})} for e in rows],
            "metrics": next(e[TREE_METRICS_KEY] for e in rows if TREE_METRICS_KEY in e),
            "trees": [tree_spend(u, e) for u, e in heads]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    """A numpy value (from a row's fields) as plain Python, anything else as its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def tree_spend(uid: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """What one tree spent (from its first leaf's extra fields), as ``bpo.tree_log`` lists it."""
    metrics = extra[TREE_METRICS_KEY]
    spend = {"uid": str(uid), "task": extra.get(TREE_TASK_KEY),
             "generated_tokens": float(metrics.get("bpo/generated_tokens", 0.0)),
             "env_steps": float(metrics.get("bpo/env_steps", 0.0))}
    if "bpo/budget" in metrics:
        spend["budget"] = float(metrics["bpo/budget"])
    return spend


def batch_tree_call(uids: list[Any], extra_fields: list[Any],
                    bpo_config: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The ``bpo`` estimator's context for one trainer batch: every row's tree metadata (``None`` for verl's
    padding rows) and the batch's rows per tree, the advantage scale that matches the actor's loss normalizer."""
    metas = [None if is_padding_uid(u) or not isinstance(e, dict) else e.get(META_KEY)
             for u, e in zip(uids, extra_fields)]
    trees = len({u for u in uids if not is_padding_uid(u)})
    return tree_call_context(metas, bpo_config, rows_per_tree(len(uids), trees))


@register_trainer(TRAINER_MODE)
class BPOTrainer(PPOTrainerSync):
    """verl's sync trainer, plus the tree metadata hand-off to the ``bpo`` estimator (module docstring)."""

    def __init__(self, config: DictConfig) -> None:
        # verl keys sync semantics (replay buffer, refill, checkpointed queue state) on the name "sync"; the
        # registry name only chose this class.
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)
        estimator = config.algorithm.adv_estimator
        self.bpo_config = read_bpo_config(config.get("bpo")).for_estimator(estimator)
        self.fork_policy = ForkPolicy(self.bpo_config)  # the run's one learned allocation state
        self._packed: PackedBatch | None = None  # this step's packed rows (bpo.packed)

    @property
    def _trees_bpo(self) -> bool:
        return self.config.algorithm.adv_estimator == ESTIMATOR_NAME

    @property
    def _packs(self) -> bool:
        """The actor trains packed trees (``bpo.packed``, :mod:`~verl_bpo.integration.packed_rows`)."""
        return self._trees_bpo and self.bpo_config.packed

    @property
    def _minibatches(self) -> int:
        return self.config.data.train_batch_size // self.config.actor_rollout_ref.actor.ppo_mini_batch_size

    def _submit_batch_to_rollout(self, batch) -> int:
        rollout_n = self.config.actor_rollout_ref.rollout.n
        sessions = self.bpo_config.leaf_cap(rollout_n) if self._trees_bpo else rollout_n
        # Always set: the tree's session count and verl's must agree, whatever a dataset row carries.
        batch["__rollout_n__"] = torch.full((len(batch),), sessions, dtype=torch.int64)
        extras = column(batch, "extra_info") if "extra_info" in batch.keys() else [None] * len(batch)
        states = rollout_states(self.fork_policy, sessions, extras, dataclasses.asdict(self.bpo_config.sandbox))
        tu.assign_non_tensor_stack(batch, STATE_KEY, states)
        return super()._submit_batch_to_rollout(batch)

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        if self._packs:  # one packed row per tree (padded to the ranks), one mini-batch
            return dp_size
        multiple = super()._get_required_batch_multiple(dp_size)
        return batch_multiple(multiple, self._minibatches, dp_size) if self._trees_bpo else multiple

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not self._packs:
            return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)
        # The leaf rows never reach the actor: pack them, then let verl balance the trees across its ranks.
        wg = self.actor_rollout_wg
        if "actor" not in wg._dispatch_info:
            wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
        dp_size = max(wg._dispatch_info["actor"]) + 1
        self._packed = PackedBatch.build(batch, dp_size, self.tokenizer.eos_token_id, self._micro_batch_tokens)
        metrics.update(self._packed.metrics())
        self._packed.meta = super()._balance_batch(self._packed.meta, metrics, logging_prefix, keep_minibatch)
        return batch

    @property
    def _micro_batch_tokens(self) -> int:
        """Tokens per actor micro-batch: the configured budget, or the leaf layout's micro-batch at full length."""
        actor, data = self.config.actor_rollout_ref.actor, self.config.data
        if actor.get("use_dynamic_bsz", False):
            return int(actor.ppo_max_token_len_per_gpu)
        return int(actor.ppo_micro_batch_size_per_gpu) * int(data.max_prompt_length + data.max_response_length)

    def _compute_old_log_prob(self, batch, metrics: dict):
        if not self._packs:
            return super()._compute_old_log_prob(batch, metrics)
        super()._compute_old_log_prob(self._packed.fresh_meta(), metrics)
        self._packed.to_leaves("old_log_probs")  # verl's KL-in-reward and metrics read them on the leaf rows
        return batch

    def _compute_ref_log_prob(self, batch, metrics: dict):
        if not self._packs:
            return super()._compute_ref_log_prob(batch, metrics)
        super()._compute_ref_log_prob(self._packed.fresh_meta(), metrics)
        self._packed.to_leaves("ref_log_prob")
        return batch

    def _compute_advantage(self, batch, metrics: dict):
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "extra_fields"])
        uids, extra_fields = column(data, "uid"), column(data, "extra_fields")
        metrics.update(batch_tree_metrics(uids, extra_fields))
        check_reset_failures(uids, extra_fields)
        learn_from_batch(self.fork_policy, uids, extra_fields)
        metrics.update(self.fork_policy.metrics())
        log = (self.config.get("bpo") or {}).get("tree_log")
        if log:
            append_tree(log, self.global_steps, uids, extra_fields)
        if not self._trees_bpo:
            return super()._compute_advantage(batch, metrics)
        bpo_config = OmegaConf.to_container(self.config.bpo, resolve=True) if "bpo" in self.config else None
        with batch_tree_call(uids, extra_fields, bpo_config) as call:
            batch = super()._compute_advantage(batch, metrics)
        metrics.update(call["stats"])
        if self._packs:
            self._packed.from_leaves()
        return batch

    def _save_checkpoint(self):
        # First: verl marks the checkpoint as the latest once its own parts are written, and a checkpoint marked
        # latest must hold the state a resume needs.
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        save_allocation_state(self.fork_policy, folder)
        super()._save_checkpoint()

    def _load_checkpoint(self):
        result = super()._load_checkpoint()
        if self.global_steps > 0:  # verl resumed from global_step_<n>: continue the allocation state saved there
            trainer = self.config.trainer
            folder = (trainer.resume_from_path if trainer.resume_mode == "resume_path"
                      else os.path.join(trainer.default_local_dir, f"global_step_{self.global_steps}"))
            load_allocation_state(self.fork_policy, folder if os.path.isabs(folder) else os.path.abspath(folder))
        return result

    def _update_actor(self, batch, metrics: dict):
        if not self._trees_bpo:
            return super()._update_actor(batch, metrics)
        if not self._packs:
            with self._minibatch_rows(minibatch_rows(len(batch), self._minibatches)):
                return super()._update_actor(batch, metrics)
        packed, self._packed = self._packed, None
        try:
            with self._minibatch_rows(len(packed.meta)):
                super()._update_actor(packed.fresh_meta(), metrics)
        finally:
            packed.clear()
        return batch

    @contextlib.contextmanager
    def _minibatch_rows(self, rows: int) -> Iterator[None]:
        """verl sizes the actor's mini-batch as ``ppo_mini_batch_size · rollout.n`` rows (its loss normalizer,
        ``global_batch_size``); for the duration of one update that product is set to ``rows``."""
        actor, rollout = self.config.actor_rollout_ref.actor, self.config.actor_rollout_ref.rollout
        saved = actor.ppo_mini_batch_size, rollout.n
        with open_dict(self.config):
            actor.ppo_mini_batch_size, rollout.n = rows, 1
        try:
            yield
        finally:
            with open_dict(self.config):
                actor.ppo_mini_batch_size, rollout.n = saved


def save_allocation_state(policy: ForkPolicy, folder: str) -> None:
    """Write ``policy``'s state into a checkpoint folder (atomically: a crash mid-write leaves the old file)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    with open(path + ".part", "w") as f:
        json.dump(policy.state_dict(), f)
    os.replace(path + ".part", path)


def load_allocation_state(policy: ForkPolicy, folder: str) -> None:
    """Continue ``policy`` from a checkpoint folder's state. A checkpoint without one (written by a plain verl
    trainer or an older verl-bpo) is an error for a learned allocation, since starting its warm-up again would
    silently change the run; a run that learns nothing from it goes on."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        if not policy.learned:
            logger.warning("%s is missing; this run's allocation learns nothing from it, so it goes on", path)
            return
        raise FileNotFoundError(
            f"{path} is missing: this checkpoint has no BPO allocation state. Resume from a checkpoint a BPO run "
            "wrote, or start a fresh run (trainer.resume_mode=disable)")
    with open(path) as f:
        policy.load_state_dict(json.load(f))


@ray.remote
class BPOTaskRunner:
    """``TaskRunnerV1`` with :class:`BPOTrainer` (verl: ``trainer/main_ppo.py``, ``TaskRunnerV1.run``)."""

    def run(self, config: DictConfig) -> None:
        configure_verl_logging()
        import verl_bpo.integration.estimator  # noqa: F401  (registers "bpo" here even if entry points are disabled)

        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        tq.init(config.transfer_queue)
        trainer, succeeded = None, False
        try:
            trainer = BPOTrainer(config=config)
            trainer.init()
            manager_fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
            manager_cls = load_class_from_fqn(manager_fqn, "AgentLoopManager") if manager_fqn else AgentLoopManagerTQ
            manager = manager_cls.create(
                config=config,
                llm_client=trainer.get_llm_client(),
                teacher_client=trainer.get_teacher_client(),
                reward_loop_worker_handles=trainer.get_reward_handles(),
            )
            trainer.fit(manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()
