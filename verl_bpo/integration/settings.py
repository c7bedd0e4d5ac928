"""The ``bpo`` block inside verl's hydra config, and every check a BPO run makes before Ray starts.

The block's schema is :class:`~verl_bpo.core.config.BPOConfig` itself, registered in hydra's ConfigStore as
``bpo: schema`` (``config/bpo_trainer.yaml`` lists it in its defaults), so the dataclass is the only place a field,
its type and its default are written. :func:`prepare_config` reads the block and checks everything a run would
otherwise find out minutes later, after Ray, vLLM and the models have started: the verl settings the tree depends
on, the data files, the sandbox of the ``bpo`` block and of every dataset row (its name, its config keys, and that
``bpo.step_timeout_s`` leaves room for the slowest step its own limits allow). Each failure is a ``ValueError``
that names the key and the fix. Both launch paths run it: ``python -m verl_bpo.main`` and verl's stock ``main_ppo``
(:mod:`verl_bpo.integration.stock_launch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from sandbox_adapters.registry import check_sandbox_config, min_step_timeout_s
from verl_bpo.core.config import ROLLOUT_N, BPOConfig
from verl_bpo.integration.agent_loop import AGENT_NAME
from verl_bpo.integration.estimator import ESTIMATOR_NAME

__all__ = ["register_schema", "read_bpo_config", "prepare_config", "AGENT_LOOPS_YAML", "TREE_LOSS_AGG_MODES",
           "DATA_FILE_KEYS"]

AGENT_LOOPS_YAML = Path(__file__).parent / "config" / "agent_loops.yaml"
TREE_LOSS_AGG_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm")
DATA_FILE_KEYS = ("data.train_files", "data.val_files")


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
    rollout = config.actor_rollout_ref.rollout
    if not config.trainer.get("use_v1", True):
        raise ValueError("BPO runs on verl's v1 trainer; remove trainer.use_v1=False")
    if not rollout.get("calculate_log_probs", False):
        raise ValueError("actor_rollout_ref.rollout.calculate_log_probs=False: the bpo_tree agent loop scores forks "
                         "and records turns with the rollout log-probs; set it to True")
    if estimator == ESTIMATOR_NAME:
        _check_tree_training(config, bpo)
    bpo.for_estimator(estimator).check_leaves(rollout.n)
    default_spec = dataclasses.asdict(bpo.sandbox)
    _check_sandbox(default_spec, bpo, "bpo.sandbox")
    for origin, spec in _dataset_sandboxes(config, require_tree_agent=estimator == ESTIMATOR_NAME):
        _check_sandbox(default_spec if spec is None else spec, bpo, origin)
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


def _check_sandbox(spec: Mapping[str, Any], bpo: BPOConfig, origin: str) -> None:
    """The sandbox ``spec`` (``{"name", "config"}``) exists, takes its config keys, and fits ``bpo.step_timeout_s``."""
    name, sandbox_config = spec.get("name"), spec.get("config") or {}
    try:
        built = check_sandbox_config(name, sandbox_config)
    except (TypeError, ValueError) as exc:
        if origin == "bpo.sandbox":
            raise
        raise ValueError(f"{origin}: {exc}; fix the dataset (verl_bpo.data.sandbox_rows writes valid rows)") from exc
    needed = min_step_timeout_s(name, sandbox_config)
    if bpo.step_timeout_s < needed:
        limits = {f.name: getattr(built, f.name) for f in dataclasses.fields(built) if "timeout" in f.name}
        raise ValueError(
            f"bpo.step_timeout_s={bpo.step_timeout_s:g} is shorter than one step of sandbox {name!r} may take "
            f"within its own limits ({needed:g} s with {limits}, from {origin}); a step that long would fail its "
            f"leaf. Set bpo.step_timeout_s >= {needed:g} or lower those limits"
        )


def _data_files(config: DictConfig, key: str) -> list[str]:
    value = OmegaConf.select(config, key)
    if value is None:
        return []
    return [str(v) for v in value] if OmegaConf.is_list(value) or isinstance(value, list) else [str(value)]


def _dataset_sandboxes(config: DictConfig, require_tree_agent: bool) -> Iterator[tuple[str, dict | None]]:
    """``(origin, spec)`` for each distinct ``extra_info.sandbox`` of the rows of every local data file (``None``
    for rows that fall back to ``bpo.sandbox``), after checking that each file exists and, for the ``bpo``
    estimator, that no row names another agent loop than ``bpo_tree``."""
    for key in DATA_FILE_KEYS:
        for path in _data_files(config, key):
            if "://" in path:
                continue  # hdfs:// and other remote files are fetched by verl on the workers
            local = Path(os.path.expanduser(path))
            if not local.is_file():
                raise ValueError(
                    f"{key}={path} does not exist (looked for {local.resolve()}); write the rows with "
                    f"`python -m verl_bpo.data.prepare ...` or verl_bpo.data.write_sandbox_dataset and point {key} "
                    "at the file"
                )
            if local.suffix != ".parquet":
                continue
            seen: set[str] = set()
            for row, agent_name, spec in _read_rows(local):
                if require_tree_agent and agent_name not in (None, AGENT_NAME):
                    raise ValueError(
                        f"{key}={path}: row {row} has agent_name={agent_name!r}, but algorithm.adv_estimator=bpo "
                        f"needs every row in the {AGENT_NAME} agent loop; write the rows with agent_name="
                        f"{AGENT_NAME} (verl_bpo.data does) or drop the column"
                    )
                marker = json.dumps(spec, sort_keys=True, default=str)
                if marker not in seen:
                    seen.add(marker)
                    yield f"extra_info.sandbox of row {row} of {key}={path}", spec


def _read_rows(path: Path) -> Iterator[tuple[int, str | None, dict | None]]:
    """``(row, agent_name, sandbox spec)`` of each row of a parquet file; only two columns are read."""
    import pyarrow.parquet as pq

    names = set(pq.ParquetFile(path).schema_arrow.names)
    columns = [c for c in ("agent_name", "extra_info") if c in names]
    table = pq.read_table(path, columns=columns) if columns else None
    rows = table.num_rows if table is not None else 0
    agents = table.column("agent_name").to_pylist() if "agent_name" in columns else [None] * rows
    extras = table.column("extra_info").to_pylist() if "extra_info" in columns else [None] * rows
    for row, (agent_name, extra) in enumerate(zip(agents, extras)):
        spec = extra.get("sandbox") if isinstance(extra, Mapping) else None
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: row {row}: extra_info.sandbox is not JSON ({exc})") from exc
        if spec is not None and not (isinstance(spec, Mapping) and isinstance(spec.get("name"), str)):
            raise ValueError(f"{path}: row {row}: extra_info.sandbox must be {{'name': ..., 'config': {{...}}}}, "
                             f"got {spec!r}")
        yield row, agent_name, None if spec is None else dict(spec)
