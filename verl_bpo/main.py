"""``python -m verl_bpo.main <verl overrides> algorithm.adv_estimator=bpo bpo.k=2 ...``

verl's ``main_ppo`` with the BPO config (``config/bpo_trainer.yaml`` = verl's ``ppo_trainer`` + a ``bpo:`` block) and
the BPO TaskRunner. Every check that can fail runs here, before Ray starts or any model loads.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

import verl_bpo.estimator  # noqa: F401  (registers "bpo")
from verl_bpo.agent_loop import AGENT_NAME
from verl_bpo.config import BPOConfig, sampler_config_from
from verl_bpo.estimator import ESTIMATOR_NAME

__all__ = ["prepare_config", "main"]

AGENT_LOOPS_YAML = Path(__file__).parent / "config" / "agent_loops.yaml"
TREE_LOSS_AGG_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm")


def prepare_config(config: DictConfig) -> BPOConfig:
    """Validate the BPO-relevant settings and wire the agent loop; raises ``ValueError`` naming the fix."""
    bpo = BPOConfig.from_config(config.get("bpo", {}))
    estimator = config.algorithm.adv_estimator
    get_adv_estimator_fn(estimator)  # an unknown estimator fails now, not after the models load
    rollout = config.actor_rollout_ref.rollout
    if not config.trainer.get("use_v1", True):
        raise ValueError("BPO runs on verl's v1 trainer; remove trainer.use_v1=False")
    if estimator == ESTIMATOR_NAME:
        if rollout.n < 2:
            raise ValueError(f"actor_rollout_ref.rollout.n={rollout.n} is the number of leaves per tree; BPO needs >= 2")
        if bpo.mode == "flat":
            raise ValueError("algorithm.adv_estimator=bpo with bpo.mode=flat is plain RLOO; use adv_estimator=rloo")
        mode = config.actor_rollout_ref.actor.loss_agg_mode
        if mode not in TREE_LOSS_AGG_MODES:
            raise ValueError(
                f"actor_rollout_ref.actor.loss_agg_mode={mode} reweights turns by length and biases the BPO "
                f"gradient; set it to one of {list(TREE_LOSS_AGG_MODES)}"
            )
        if rollout.agent.default_agent_loop != AGENT_NAME:
            raise ValueError(
                f"actor_rollout_ref.rollout.agent.default_agent_loop={rollout.agent.default_agent_loop}: the bpo "
                f"estimator needs the tree agent loop; set it to {AGENT_NAME}"
            )
    # Builds (and so validates) the sampler settings exactly as the agent loop will.
    sampler_config_from(bpo, n_leaves=rollout.n, estimator=estimator, response_length=rollout.response_length)
    with open_dict(config):
        if not rollout.agent.get("agent_loop_config_path"):
            rollout.agent.agent_loop_config_path = str(AGENT_LOOPS_YAML)
    return bpo


@hydra.main(config_path="config", config_name="bpo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    prepare_config(config)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    from verl_bpo.trainer import BPOTaskRunner  # imports verl's trainer stack only once the config is known good

    run_ppo(config, task_runner_class=BPOTaskRunner)


if __name__ == "__main__":
    main()
