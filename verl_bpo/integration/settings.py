"""The ``bpo`` block inside verl's hydra config, and every check a BPO run makes before Ray starts.

The block's schema is :class:`~verl_bpo.core.config.BPOConfig` itself, registered in hydra's ConfigStore as
``bpo: schema`` (``config/bpo_trainer.yaml`` lists it in its defaults), so the dataclass is the only place a field,
its type and its default are written. :func:`prepare_config` reads the block and checks everything a run would
otherwise find out minutes later, after Ray, vLLM and the models have started: the verl settings the tree depends
on, the data files, the sandbox of the ``bpo`` block and of every dataset row (its name, its config keys, and that
``bpo.step_timeout_s`` leaves room for the slowest step its own limits allow), the task of every row the tree agent
loop runs (present, and what its sandbox's reset reads), the settings the workers would refuse only after the models
load, and, when the rollouts run on this node, the sandboxes' runtimes (bubblewrap, a Docker engine). Each failure
is a ``ValueError`` that names the key and the fix. Both launch paths run it: ``python -m verl_bpo.main`` and verl's
stock ``main_ppo`` (:mod:`verl_bpo.integration.stock_launch`).
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

from sandbox_adapters.registry import (
    SandboxRuntimeMissing,
    check_runtime,
    check_sandbox_config,
    check_task,
    min_step_timeout_s,
)
from verl_bpo.core.config import ROLLOUT_N, Allocation, BPOConfig, ForkScore, Mode, SandboxSpec
from verl_bpo.integration.agent_loop import AGENT_NAME, BUDGET_FIELD, row_budget
from verl_bpo.integration.estimator import ESTIMATOR_NAME
from verl_bpo.integration.stock_launch import TRAINER_ENV_KEY
from verl_bpo.integration.tree_attention import check_supported

__all__ = ["register_schema", "read_bpo_config", "prepare_config", "AGENT_LOOPS_YAML", "TREE_LOSS_AGG_MODES",
           "DATA_FILE_KEYS"]

AGENT_LOOPS_YAML = Path(__file__).parent / "config" / "agent_loops.yaml"
TREE_LOSS_AGG_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm")
DATA_FILE_KEYS = ("data.train_files", "data.val_files")


def register_schema() -> None:
    """``bpo: schema`` in hydra's ConfigStore: the defaults and types of :class:`BPOConfig`, its blocks
    (``bpo.fixed``, ``bpo.learned``, ``bpo.ablation``, ``bpo.sandbox``) included. Hydra refuses an unknown key and
    a value outside a choice's enum (``bpo.allocation=bogus``) when it composes; :func:`read_bpo_config` then runs
    the dataclass's own checks."""
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
    # The sampler builds its fork scorer for every tree and flat group (verl_bpo/rollout/scoring.py, ForkScorer),
    # which refuses this score with verl's clients; without this check it would fail in every agent-loop worker.
    if bpo.fixed.score == ForkScore.next_token_entropy:
        raise ValueError(
            "bpo.fixed.score=next_token_entropy needs an LLM client that returns the full next-token distribution; "
            "verl's vLLM/SGLang servers return only the sampled tokens' log-probs, so every tree would fail in the "
            "agent-loop workers after the models load. Set bpo.fixed.score=parent_turn_surprisal (free) or "
            "probe_surprisal (a short discarded probe per candidate)"
        )
    if estimator == ESTIMATOR_NAME:
        _check_tree_training(config, bpo)
        if bpo.packed:
            _check_packing(config)
        # Every Ray process of the run imports the plugin; with this variable it also installs the engine that
        # trains packed tree rows in the actor workers (verl_bpo/integration/plugin.py).
        OmegaConf.update(config, TRAINER_ENV_KEY, "1", force_add=True)
    bpo.for_estimator(estimator).check_leaves(rollout.n)
    default_spec = dataclasses.asdict(bpo.sandbox)
    _check_sandbox(default_spec, bpo, "bpo.sandbox")
    used = _check_datasets(config, bpo, default_spec, require_tree_agent=estimator == ESTIMATOR_NAME,
                           grows_trees=bpo.for_estimator(estimator).mode == Mode.tree)
    if _rollouts_run_here(config):
        _check_runtimes(used)
    if estimator == ESTIMATOR_NAME:
        # Last, so that a config with verl's default mini-batch still reports its other mistakes first.
        _check_minibatches(config)
    with open_dict(config):
        if not rollout.agent.get("agent_loop_config_path"):
            rollout.agent.agent_loop_config_path = str(AGENT_LOOPS_YAML)
    return bpo


def _check_tree_training(config: DictConfig, bpo: BPOConfig) -> None:
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    if rollout.n < 2:
        raise ValueError(f"{ROLLOUT_N}={rollout.n} is the number of leaves per tree; BPO needs >= 2")
    if bpo.mode == Mode.flat:
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
    algorithm = config.algorithm
    # The estimator refuses it too (verl_bpo/core/tree.py, compute_credit), but in the TaskRunner, after the first
    # rollout.
    gamma = algorithm.get("gamma", 1.0)
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"algorithm.gamma={gamma} is the per-turn discount of the tree's returns; set it in (0, 1]")
    # verl's adaptive controller steers kl_coef by the batch's KL averaged over rows with equal weight
    # (verl/trainer/ppo/ray_trainer.py:108-112, apply_kl_penalty: mean over rows, then kl_ctrl.update). On a tree
    # that average over-counts shared prefixes and forked subtrees, so the coefficient chases a biased KL. The fixed
    # controller applies the same coefficient to every token, which the tree credits correctly.
    if algorithm.get("use_kl_in_reward", False) and OmegaConf.select(algorithm, "kl_ctrl.type") == "adaptive":
        raise ValueError(
            "algorithm.kl_ctrl.type=adaptive with algorithm.use_kl_in_reward=True adapts the KL coefficient to the "
            "KL averaged over leaf rows with equal weight, which is biased on a tree; set algorithm.kl_ctrl.type="
            "fixed (and choose algorithm.kl_ctrl.kl_coef)"
        )


def _check_packing(config: DictConfig) -> None:
    """Settings the packed tree rows (``bpo.packed``, verl_bpo/core/packing.py) cannot honour."""
    ref = config.actor_rollout_ref
    off = "or set bpo.packed=false (one row per leaf, the same gradient at more trainer tokens)"
    for role in ("actor", "ref"):
        sp = OmegaConf.select(ref, f"{role}.ulysses_sequence_parallel_size", default=1) or 1
        if sp > 1:
            raise ValueError(
                f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size={sp}: a packed tree's attention follows "
                f"its branches, which Ulysses' all-to-all over sequence shards does not; set it to 1 {off}")
    loss_mode = OmegaConf.select(ref, "actor.policy_loss.loss_mode", default="vanilla")
    if loss_mode != "vanilla":
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}: a packed tree trains each shared token once "
            "with the sum of its copies' advantages, exact only for a per-token loss that is positively homogeneous "
            f"in the advantage (vanilla PPO-clip, with or without dual-clip); set it to vanilla {off}")
    attn = OmegaConf.select(ref, "model.override_config.attn_implementation", default=None)
    if attn is not None:  # verl's default is flash_attention_2, which packing hooks
        try:
            check_supported(attn)
        except ValueError as exc:
            raise ValueError(f"{exc} {off}") from None


def _check_minibatches(config: DictConfig) -> None:
    """One actor mini-batch per training step, so that no optimizer step sees part of a tree.

    The BPO loss is exact when every tree's leaf rows reach the same optimizer step (batch_layout.py). What verl
    0.9.1's v1 trainer does to the rows of a step (paths under site-packages/verl):

    * it always reorders them across data-parallel ranks by length (trainer/ppo/v1/trainer_base.py:582 calls
      _balance_batch unconditionally; :1626-1627 Karmarkar-Karp partitions, then reorder). ``trainer.balance_batch``
      is read only by the legacy and experimental trainers, so it changes nothing here and is not checked;
    * each rank then cuts its rows into ``ppo_mini_batch_size / dp`` row mini-batches, shuffled when
      ``actor.shuffle=True`` (workers/engine_workers.py:262-279, utils/tensordict_utils.py:559-611), one optimizer
      step each; mini-batch j is the j-th cut of every rank.

    With one mini-batch (``ppo_mini_batch_size == train_batch_size``) all rows reach one optimizer step per epoch,
    whatever their order: the split across ranks and micro-batches is exact, because each rank scales its row sum
    by dp_size / the global row count (trainer/ppo/core_algos.py:1188, agg_loss) and FSDP averages the ranks'
    gradients (:1177-1179), which leaves the sum over all rows / the global row count (BPOTrainer sets that count,
    batch_layout.minibatch_rows); so the reorder, ``actor.shuffle`` and ``ppo_epochs`` are safe. With
    more mini-batches the length reorder (dp > 1), the shuffle, and trees whose leaf counts do not tile a mini-batch
    each put a tree's leaves into different optimizer steps, chosen by length, i.e. by what happened in them.
    """
    batch = config.data.train_batch_size
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    if mini != batch:
        raise ValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} with data.train_batch_size={batch}: BPO needs one "
            "optimizer step per batch (verl's v1 trainer reorders a step's rows by length across data-parallel "
            "ranks and cuts them into mini-batches, which splits a tree's leaves over several steps and makes "
            f"each step's gradient a biased part of the tree's); set actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{batch} (= data.train_batch_size; use ppo_epochs for more updates per batch)"
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


def _default_is_explicit(bpo: BPOConfig) -> bool:
    """Whether ``bpo.sandbox`` was chosen: anything but the dataclass default (``smoke``, no config), which hydra's
    schema fills in when the user sets nothing, so it is no evidence of intent."""
    return bpo.sandbox != SandboxSpec()


def _check_datasets(config: DictConfig, bpo: BPOConfig, default_spec: dict, require_tree_agent: bool,
                    grows_trees: bool = False) -> dict[str, dict]:
    """Check every local data file and every row the ``bpo_tree`` agent loop will run; returns ``{origin: spec}``
    of the distinct sandboxes those rows use (``bpo.sandbox`` included when some row, or a file not read here, may
    fall back to it).

    Per file: it exists. Per row: for the ``bpo`` estimator, no other agent loop than ``bpo_tree``; its
    ``extra_info.sandbox`` (name, config keys, step timeout); and, for rows of the tree loop, a task that its
    sandbox can reset to, and an ``extra_info.bpo_budget`` that is a positive number, in a run whose trees read it
    (``bpo.allocation=learned``; the fixed rule grows exactly N leaves and would ignore it). A row without
    ``extra_info.sandbox`` would silently run in ``bpo.sandbox``: refused unless ``bpo.sandbox`` was set and takes the
    row's task."""
    default_loop = config.actor_rollout_ref.rollout.agent.get("default_agent_loop")
    explicit = _default_is_explicit(bpo)
    used: dict[str, dict] = {}
    seen: dict[str, str] = {}  # spec marker -> origin of its first row
    unread = False  # a file whose rows are not read here (remote, not parquet) may fall back to bpo.sandbox
    files = [(key, path) for key in DATA_FILE_KEYS for path in _data_files(config, key)]
    for key, path in files:
        if "://" in path:
            unread = True
            continue  # hdfs:// and other remote files are fetched by verl on the workers
        local = Path(os.path.expanduser(path))
        if not local.is_file():
            raise ValueError(
                f"{key}={path} does not exist (looked for {local.resolve()}); write the rows with "
                f"`python -m verl_bpo.data.prepare ...` or verl_bpo.data.write_sandbox_dataset and point {key} "
                "at the file"
            )
        if local.suffix != ".parquet":
            unread = True
            continue
        where = f"{key}={path}"
        for row, agent_name, spec, task, extra in _read_rows(local):
            if require_tree_agent and agent_name not in (None, AGENT_NAME):
                raise ValueError(
                    f"{where}: row {row} has agent_name={agent_name!r}, but algorithm.adv_estimator=bpo "
                    f"needs every row in the {AGENT_NAME} agent loop; write the rows with agent_name="
                    f"{AGENT_NAME} (verl_bpo.data does) or drop the column"
                )
            if spec is not None:
                marker = json.dumps(spec, sort_keys=True, default=str)
                if marker not in seen:
                    seen[marker] = f"extra_info.sandbox of row {row} of {where}"
                    _check_sandbox(spec, bpo, seen[marker])
                    used[seen[marker]] = spec
            if (agent_name or default_loop) != AGENT_NAME:
                continue  # another agent loop runs this row; its sandbox and task are not ours to read
            if spec is None:
                if not explicit:
                    raise ValueError(
                        f"{where}: row {row} has no extra_info.sandbox, so the {AGENT_NAME} agent loop would run it "
                        f"in bpo.sandbox, left at its default ({bpo.sandbox.name!r} with no config): that is rarely "
                        "the row's sandbox, and a task the sandbox cannot reset fails every leaf of its tree (zero "
                        "advantages, a silent zero gradient). Write the rows with verl_bpo.data (sandbox_rows + "
                        "write_sandbox_dataset, or `python -m verl_bpo.data.prepare`), which sets "
                        "extra_info.sandbox, or set bpo.sandbox.name (and bpo.sandbox.config) to these rows' sandbox"
                    )
                used["bpo.sandbox"] = default_spec
            _check_row_task(where, row, task, default_spec if spec is None else spec,
                            "bpo.sandbox" if spec is None else "its extra_info.sandbox")
            _check_row_budget(where, row, extra, bpo, grows_trees)
    if unread or not files:
        used["bpo.sandbox"] = default_spec
    return used


def _check_row_task(where: str, row: int, task: Any, spec: Mapping[str, Any], source: str) -> None:
    """The row's ``extra_info.task`` is a non-empty mapping (or its JSON) that sandbox ``spec`` can reset to."""
    fix = ("write the rows with verl_bpo.data (sandbox_rows stores each task as JSON in extra_info.task) or set "
           "extra_info.task to the task the sandbox resets to")
    if isinstance(task, str):
        try:
            task = json.loads(task)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: row {row}: extra_info.task is not JSON ({exc}); {fix}") from exc
    if task is None or (isinstance(task, Mapping) and not task):
        raise ValueError(f"{where}: row {row} has no extra_info.task (or an empty one), so its sandbox would reset "
                         f"to {{}} and every leaf of its tree would fail; {fix}")
    name = spec.get("name")
    try:
        check_task(name, task, spec.get("config") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: row {row}: extra_info.task does not fit sandbox {name!r} ({source}): {exc}; "
                         f"{fix}") from exc


def _check_row_budget(where: str, row: int, extra: Mapping[str, Any], bpo: BPOConfig, grows_trees: bool) -> None:
    """The row's ``extra_info.bpo_budget``, if any, is a positive number and a tree of this run reads it."""
    try:
        budget = row_budget(extra, f"row {row}")
    except ValueError as exc:
        raise ValueError(f"{where}: row {row}: {exc}") from exc
    if budget is not None and grows_trees and bpo.allocation != Allocation.learned:
        raise ValueError(
            f"{where}: row {row} has extra_info.{BUDGET_FIELD}={budget:g}, a tree budget, but "
            f"bpo.allocation={bpo.allocation} grows exactly {ROLLOUT_N} leaves per tree and would ignore it; set "
            f"bpo.allocation=learned (and bpo.learned.budget_unit to the budget's unit: turns, tokens or leaves), or "
            f"write the rows without {BUDGET_FIELD}")


def _rollouts_run_here(config: DictConfig) -> bool:
    """Whether the agent-loop workers, and so the sandboxes, run on this node: a single-node run that starts its
    own Ray (no ``ray_kwargs.ray_init.address``, no ``$RAY_ADDRESS``). Otherwise the workers check at start."""
    return (int(OmegaConf.select(config, "trainer.nnodes", default=1) or 1) == 1
            and not OmegaConf.select(config, "ray_kwargs.ray_init.address", default=None)
            and not os.environ.get("RAY_ADDRESS"))


def _check_runtimes(used: Mapping[str, Mapping[str, Any]]) -> None:
    """Each sandbox the run uses finds its runtime on this node (registry.check_runtime: bubblewrap, Docker ...)."""
    checked: set[str] = set()
    for origin, spec in used.items():
        marker = json.dumps(spec, sort_keys=True, default=str)
        if marker in checked:
            continue
        checked.add(marker)
        try:
            check_runtime(spec.get("name"), spec.get("config") or {})
        except SandboxRuntimeMissing as exc:
            raise ValueError(f"{origin}: {exc}") from exc


def _read_rows(path: Path) -> Iterator[tuple[int, str | None, dict | None, Any, dict]]:
    """``(row, agent_name, sandbox spec, task, extra_info)`` of each row of a parquet file (the task as stored: JSON
    text, a mapping or ``None``; ``extra_info`` a mapping, empty when absent); only two columns are read."""
    import pyarrow.parquet as pq

    names = set(pq.ParquetFile(path).schema_arrow.names)
    columns = [c for c in ("agent_name", "extra_info") if c in names]
    table = pq.read_table(path, columns=columns) if columns else None
    rows = table.num_rows if table is not None else 0
    agents = table.column("agent_name").to_pylist() if "agent_name" in columns else [None] * rows
    extras = table.column("extra_info").to_pylist() if "extra_info" in columns else [None] * rows
    for row, (agent_name, extra) in enumerate(zip(agents, extras)):
        extra = extra if isinstance(extra, Mapping) else {}
        # The agent loop reads `extra_info.sandbox or bpo.sandbox` and `extra_info.task or {}`: empty counts as absent.
        spec = extra.get("sandbox") or None
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: row {row}: extra_info.sandbox is not JSON ({exc})") from exc
        if spec is not None and not (isinstance(spec, Mapping) and isinstance(spec.get("name"), str)):
            raise ValueError(f"{path}: row {row}: extra_info.sandbox must be {{'name': ..., 'config': {{...}}}}, "
                             f"got {spec!r}")
        yield row, agent_name, None if spec is None else dict(spec), extra.get("task") or None, extra
