"""``python -m verl_bpo.main <verl overrides> algorithm.adv_estimator=bpo bpo.fixed.k=2 ...``

verl's ``main_ppo`` with the BPO config (``config/bpo_trainer.yaml`` = verl's ``ppo_trainer`` + the ``bpo`` block,
whose schema is :class:`~verl_bpo.core.config.BPOConfig`) and the BPO TaskRunner. Every check that can fail runs
here, before Ray starts or any model loads; a failed one exits with its message.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from verl_bpo.integration.settings import prepare_config, register_schema

__all__ = ["main"]

register_schema()  # before hydra composes bpo_trainer.yaml, whose defaults list `bpo: schema`


@hydra.main(config_path="config", config_name="bpo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    try:
        prepare_config(config)
    except ValueError as exc:
        raise SystemExit(f"verl-bpo: {exc}") from None
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    from verl_bpo.integration.trainer import BPOTaskRunner  # verl's trainer stack, once the config is known good

    run_ppo(config, task_runner_class=BPOTaskRunner)
