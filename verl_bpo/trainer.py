"""verl glue: the sync trainer that hands tree metadata to the ``bpo`` estimator, and its TaskRunner.

``BPOTrainer`` is verl's own ``PPOTrainerSync`` (``trainer_mode=sync``, unchanged semantics) with one override:
before the advantage step it fetches each row's ``extra_fields`` from the TransferQueue, logs the tree metrics,
and — for ``algorithm.adv_estimator=bpo`` only — runs verl's advantage code inside
:func:`~verl_bpo.estimator.tree_call_context`, so the registered estimator sees the tree. Every other estimator
runs verl's code unchanged. ``BPOTaskRunner`` is verl's ``TaskRunnerV1.run`` with this trainer class (the
``run_ppo(config, task_runner_class=...)`` hook verl provides for recipes).
"""

from __future__ import annotations

import collections
from pprint import pprint
from typing import Any

import ray
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, PPOTrainerSync
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.logging_utils import configure_verl_logging

from verl_bpo.agent_loop import TREE_METRICS_KEY
from verl_bpo.estimator import ESTIMATOR_NAME, tree_call_context
from verl_bpo.tree_meta import META_KEY, is_padding_uid

__all__ = ["BPOTrainer", "BPOTaskRunner", "tree_metrics", "column"]


def column(data: Any, key: str) -> list[Any]:
    """A non-tensor TensorDict column as a plain list (``.get`` gives a NonTensorStack, ``[]`` a LinkedList)."""
    value = data.get(key)
    return value.tolist() if hasattr(value, "tolist") else list(value)


def tree_metrics(uids: list[Any], extra_fields: list[Any]) -> dict[str, float]:
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


class BPOTrainer(PPOTrainerSync):
    """verl's sync trainer, plus the tree metadata hand-off to the ``bpo`` estimator (module docstring)."""

    def _compute_advantage(self, batch, metrics: dict):
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "extra_fields"])
        uids, extra_fields = column(data, "uid"), column(data, "extra_fields")
        metrics.update(tree_metrics(uids, extra_fields))
        if self.config.algorithm.adv_estimator != ESTIMATOR_NAME:
            return super()._compute_advantage(batch, metrics)
        metas = [None if is_padding_uid(u) or not isinstance(e, dict) else e.get(META_KEY)
                 for u, e in zip(uids, extra_fields)]
        bpo_config = self.config.get("bpo", None)
        with tree_call_context(metas, OmegaConf.to_container(bpo_config) if bpo_config is not None else None) as call:
            batch = super()._compute_advantage(batch, metrics)
        metrics.update(call["stats"])
        return batch


@ray.remote
class BPOTaskRunner:
    """``TaskRunnerV1`` with :class:`BPOTrainer` (verl: ``trainer/main_ppo.py``, ``TaskRunnerV1.run``)."""

    def run(self, config: DictConfig) -> None:
        configure_verl_logging()
        import verl_bpo.estimator  # noqa: F401  (registers "bpo" here even if entry points are disabled)

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
