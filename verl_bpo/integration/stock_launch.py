"""verl's stock ``python -m verl.trainer.main_ppo ... algorithm.adv_estimator=bpo`` trains BPO.

verl imports this package's ``verl.plugins`` entry point (:mod:`verl_bpo.integration.plugin`) on ``import verl``, in
every process. In a process that runs verl's stock ``main_ppo``, :func:`hook_stock_main_ppo` appends one hydra
callback to the command line (``hydra.callbacks.verl_bpo``). Hydra then composes the config exactly as it always
does (command line, ``--config-path``/``--config-name`` YAML, config groups) and hands it to
:meth:`StockLaunch.on_run_start` before ``main_ppo``'s own code runs, so before Ray starts. A config whose
``algorithm.adv_estimator`` is not ``bpo`` is left as it is. For ``bpo`` the callback

1. gives each key that ``config/bpo_trainer.yaml`` sets (loss aggregation and its constant divisor, rollout
   log-probs, the ``bpo_tree`` agent loop) BPO's value where the config still holds verl's default and the
   command line does not name the key — the same defaults ``python -m verl_bpo.main`` starts from;
2. selects :class:`~verl_bpo.integration.trainer.BPOTrainer` through verl's trainer registry
   (``trainer.v1.trainer_mode=bpo``; it runs verl's sync mode) and sets ``VERL_BPO_TRAINER=1`` for the run's Ray
   workers (``ray_kwargs.ray_init.runtime_env.env_vars``), so the plugin registers BPOTrainer in each of them, the
   TaskRunner that looks it up included (after the optional CPU platform: importing verl's trainer needs the
   platform);
3. runs :func:`~verl_bpo.integration.settings.prepare_config`, every check before Ray starts (which also points
   ``agent_loop_config_path`` at the ``bpo_tree`` registry entry when it is empty). A failing check exits with its
   message.

It prints one line naming every key it set. ``VERL_BPO_STOCK_LAUNCH=0`` turns the hook off (the ``bpo`` estimator
stays registered); verl's own ``VERL_USE_EXTERNAL_PLUGINS=none`` turns off the whole plugin.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["STOCK_LAUNCH_ENV", "TRAINER_ENV", "TRAINER_ENV_KEY", "CALLBACK_OVERRIDE", "StockLaunch", "hook_stock_main_ppo",
           "stock_main_ppo_args", "prepare_stock_config", "verl_defaults"]

STOCK_LAUNCH_ENV = "VERL_BPO_STOCK_LAUNCH"
CALLBACK_OVERRIDE = "++hydra.callbacks.verl_bpo._target_=verl_bpo.integration.stock_launch.StockLaunch"
TRAINER_ENV = "VERL_BPO_TRAINER"  # "1" in the Ray workers of a BPO run: the plugin imports (registers) BPOTrainer
_ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
TRAINER_ENV_KEY = f"{_ENV_VARS_KEY}.{TRAINER_ENV}"  # where a config hands it to every Ray process
_BPO_TRAINER_YAML = Path(__file__).parent / "config" / "bpo_trainer.yaml"


def trainer_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process belongs to a BPO run started through verl's stock main_ppo (module docstring)."""
    return (os.environ if environ is None else environ).get(TRAINER_ENV, "") == "1"


def hook_enabled(environ: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(STOCK_LAUNCH_ENV, "1")
    return value.strip().lower() not in ("0", "false", "off", "no")


def stock_main_ppo_args(argv: Sequence[str]) -> int | None:
    """Index where main_ppo's own arguments start in an interpreter command line, or None for other programs."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "verl.trainer.main_ppo":
            return i + 2
        if str(arg).replace("\\", "/").endswith("verl/trainer/main_ppo.py"):
            return i + 1
    return None


def hook_stock_main_ppo(orig_argv: Sequence[str] | None = None, argv: list[str] | None = None) -> bool:
    """Add :class:`StockLaunch` to a stock ``main_ppo`` command line (``argv``, default ``sys.argv``); True if it did.

    ``sys.orig_argv`` tells which program this is: under ``python -m``, verl is imported (and this runs) while
    runpy is still importing the package, before it rewrites ``sys.argv[0]``; hydra reads ``sys.argv`` later.
    """
    if not hook_enabled():
        return False
    if stock_main_ppo_args(list(sys.orig_argv) if orig_argv is None else orig_argv) is None:
        return False
    argv = sys.argv if argv is None else argv
    if CALLBACK_OVERRIDE not in argv:
        argv.append(CALLBACK_OVERRIDE)
    return True


def _is_bpo(config: DictConfig) -> bool:
    from verl_bpo.integration.estimator import ESTIMATOR_NAME

    return OmegaConf.select(config, "algorithm.adv_estimator", default=None) == ESTIMATOR_NAME


class StockLaunch(Callback):
    """The hydra callback :func:`hook_stock_main_ppo` adds (module docstring). Hydra turns exceptions raised in a
    callback into warnings, so a failed check exits (``SystemExit``) with its message instead."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not _is_bpo(config):
            return
        try:
            changes = prepare_stock_config(config)
        except ValueError as exc:
            raise SystemExit(f"verl-bpo: {exc}") from None
        print(f"verl-bpo: algorithm.adv_estimator=bpo through verl's main_ppo: {', '.join(changes)} "
              f"(turn this off with {STOCK_LAUNCH_ENV}=0)", flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from verl_bpo.integration.trainer import TRAINER_MODE

        # Under --multirun hydra composes each job after on_run_start's place and copies it before any callback
        # could change it, so nothing above was applied.
        if _is_bpo(config) and OmegaConf.select(config, "trainer.v1.trainer_mode") != TRAINER_MODE:
            raise SystemExit("verl-bpo: hydra --multirun of verl's main_ppo with algorithm.adv_estimator=bpo is not "
                             "wired for BPO; run `python -m verl_bpo.main --multirun ...` instead")


def _explicit_keys(config: DictConfig) -> set[str]:
    """Keys the command line sets (``key=v``, ``+key=v``, ``++key=v``, ``~key``)."""
    overrides = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    return {str(o).split("=", 1)[0].lstrip("+~") for o in overrides}


@lru_cache(maxsize=1)
def bpo_defaults() -> dict[str, Any]:
    """``{dotted key: value}`` of every verl key ``bpo_trainer.yaml`` sets (interpolations kept as written)."""
    raw = OmegaConf.to_container(OmegaConf.load(_BPO_TRAINER_YAML), resolve=False)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk({k: v for k, v in raw.items() if k not in ("hydra", "defaults")}, "")
    return out


@lru_cache(maxsize=1)
def verl_defaults() -> DictConfig:
    """verl's own defaults for every trainer key (the stock hook compares against them; actor_loss builds verl's actor
    config from them)."""
    import verl

    # verl's flattened ppo_trainer, generated and kept in sync with the composed config by verl itself.
    return OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")


_MISSING = object()


def _select(config: DictConfig, key: str) -> Any:
    return OmegaConf.select(config, key, default=_MISSING, throw_on_resolution_failure=False)


def prepare_stock_config(config: DictConfig) -> list[str]:
    """Wire a stock ``main_ppo`` config for BPO and check it (module docstring); returns the keys set, as
    ``key=value`` strings. Raises ``ValueError`` naming the fix."""
    from verl_bpo.integration.settings import prepare_config
    from verl_bpo.integration.trainer import TRAINER_MODE

    explicit, changes = _explicit_keys(config), []
    for key, value in bpo_defaults().items():
        current = _select(config, key)
        if key in explicit or value is None or current == value:
            continue
        if current is not _MISSING and current == _select(verl_defaults(), key):
            OmegaConf.update(config, key, value, force_add=True)
            changes.append(f"{key}={_select(config, key)}")
    mode = OmegaConf.select(config, "trainer.v1.trainer_mode")
    if mode not in ("sync", TRAINER_MODE):
        raise ValueError(f"trainer.v1.trainer_mode={mode}: BPO trains with verl's sync trainer (BPOTrainer is "
                         f"registered as {TRAINER_MODE!r}); remove the override")
    if mode != TRAINER_MODE:
        OmegaConf.update(config, "trainer.v1.trainer_mode", TRAINER_MODE)
        changes.append(f"trainer.v1.trainer_mode={TRAINER_MODE}")
    if str(_select(config, TRAINER_ENV_KEY)) != "1":
        OmegaConf.update(config, TRAINER_ENV_KEY, "1", force_add=True)
        changes.append(f"{TRAINER_ENV_KEY}=1")
    path_key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    had_path = bool(_select(config, path_key))
    prepare_config(config)
    if not had_path:
        changes.append(f"{path_key}={_select(config, path_key)}")
    return changes
