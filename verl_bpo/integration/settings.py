"""The ``bpo`` block inside verl's hydra config, and every check a BPO run makes before Ray starts.

The block's schema is :class:`~verl_bpo.core.config.BPOConfig` itself, registered in hydra's ConfigStore as
``bpo: schema`` (``config/bpo_trainer.yaml`` lists it in its defaults), so the dataclass is the only place a field,
its type and its default are written. :func:`prepare_config` reads the block and checks the verl settings the
tree depends on, each failure a ``ValueError`` that names the key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from sandbox_adapters.registry import check_sandbox_config
from verl_bpo.core.config import ROLLOUT_N, BPOConfig
from verl_bpo.integration.agent_loop import AGENT_NAME
from verl_bpo.integration.estimator import ESTIMATOR_NAME

__all__ = ["register_schema", "read_bpo_config", "prepare_config", "AGENT_LOOPS_YAML", "TREE_LOSS_AGG_MODES"]

AGENT_LOOPS_YAML = Path(__file__).parent / "config" / "agent_loops.yaml"
TREE_LOSS_AGG_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm")


def register_schema() -> None:
    """``bpo: schema`` in hydra's ConfigStore: the defaults and types of :class:`BPOConfig`."""
    ConfigStore.instance().store(group="bpo", name="schema", node=BPOConfig)


def read_bpo_config(config: DictConfig | dict[str, Any] | None) -> BPOConfig:
    """The ``bpo`` block of a verl config (DictConfig or dict) as a validated :class:`BPOConfig`."""
    raw = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else dict(config or {})
    return BPOConfig.from_mapping(raw)


def prepare_config(config: DictConfig) -> BPOConfig:
    """Validate the BPO-relevant settings and wire the agent loop; raises ``ValueError`` naming the fix."""
    bpo = read_bpo_config(config.get("bpo", {}))
    estimator = config.algorithm.adv_estimator
    get_adv_estimator_fn(estimator)  # an unknown estimator fails now, not after the models load
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    if not config.trainer.get("use_v1", True):
        raise ValueError("BPO runs on verl's v1 trainer; remove trainer.use_v1=False")
    if not rollout.get("calculate_log_probs", False):
        raise ValueError("actor_rollout_ref.rollout.calculate_log_probs=False: the bpo_tree agent loop scores forks "
                         "and records turns with the rollout log-probs; set it to True")
    if estimator == ESTIMATOR_NAME:
        _check_tree_training(config, bpo)
    bpo.for_estimator(estimator).check_leaves(rollout.n)
    check_sandbox_config(bpo.sandbox.name, bpo.sandbox.config)
    with open_dict(config):
        if not rollout.agent.get("agent_loop_config_path"):
            rollout.agent.agent_loop_config_path = str(AGENT_LOOPS_YAML)
    return bpo


def _check_tree_training(config: DictConfig, bpo: BPOConfig) -> None:
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    if rollout.n < 2:
        raise ValueError(f"{ROLLOUT_N}={rollout.n} is the number of leaves per tree; BPO needs >= 2")
    if bpo.mode == "flat":
        raise ValueError("algorithm.adv_estimator=bpo with bpo.mode=flat is plain RLOO; use adv_estimator=rloo")
    mode = actor.loss_agg_mode
    if mode not in TREE_LOSS_AGG_MODES:
        raise ValueError(
            f"actor_rollout_ref.actor.loss_agg_mode={mode} reweights turns by length and biases the BPO "
            f"gradient; set it to one of {list(TREE_LOSS_AGG_MODES)}"
        )
    if mode == "seq-mean-token-sum-norm" and actor.get("loss_scale_factor") is None:
        raise ValueError(
            "actor_rollout_ref.actor.loss_scale_factor=null with loss_agg_mode=seq-mean-token-sum-norm divides each "
            "micro-batch by its own padded width, which weights tree rows unevenly; set it to a constant (e.g. "
            "data.max_response_length)"
        )
    # verl's actor averages these over rows with equal weight. A tree's leaf rows duplicate shared prefixes and
    # over-sample forked subtrees, so an equal-weight average is a biased estimate of the policy's KL or entropy
    # (the tree weights row ℓ by N · w_ℓ, which verl's regularisers cannot take).
    if actor.get("use_kl_loss", False):
        raise ValueError(
            "actor_rollout_ref.actor.use_kl_loss=True averages the KL term over leaf rows with equal weight, which "
            "biases it on a tree; set it to False and use algorithm.use_kl_in_reward=True (the penalty then "
            "reaches the tree's returns and is credited like any reward)"
        )
    if actor.get("entropy_coeff", 0.0):
        raise ValueError(
            f"actor_rollout_ref.actor.entropy_coeff={actor.entropy_coeff} adds an entropy bonus averaged over leaf "
            "rows with equal weight, which biases it on a tree; set it to 0"
        )
    if rollout.agent.default_agent_loop != AGENT_NAME:
        raise ValueError(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={rollout.agent.default_agent_loop}: the bpo "
            f"estimator needs the tree agent loop; set it to {AGENT_NAME}"
        )
