"""Hydra composition of the BPO config, the stock `main_ppo` hook, and every check both entry points run before Ray."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import verl
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf, ValidationError

import verl_bpo.integration
from verl_bpo.core.config import (
    Allocation,
    BPOConfig,
    BudgetUnit,
    DiscountWeighting,
    ForkScore,
    LearnedAllocation,
    Mode,
    Selector,
)
from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.integration import stock_launch
from verl_bpo.integration.settings import AGENT_LOOPS_YAML, prepare_config, read_bpo_config, register_schema

CONFIG_DIR = str(Path(verl_bpo.integration.__file__).parent / "config")
VERL_CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
register_schema()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A real verl dataset of smoke tasks (verl_bpo.data), used as train and val files."""
    return write_sandbox_dataset(tmp_path_factory.mktemp("data") / "train.parquet",
                                 sandbox_rows("smoke", [{"task_id": i} for i in range(3)], {"length": 3}))


def data_overrides(path) -> list[str]:
    return [f"data.train_files={path}", f"data.val_files={path}"]


# BPO trains with one mini-batch per step (settings._check_minibatches); verl's default is 4 (1024 / 256).
ONE_MINIBATCH = "actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}"


@pytest.fixture()
def compose_bpo(data):
    """``bpo_trainer`` (what ``python -m verl_bpo.main`` composes) with the given overrides."""

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            return compose(config_name="bpo_trainer",
                           overrides=["actor_rollout_ref.rollout.name=vllm", ONE_MINIBATCH, *data_overrides(data),
                                      *overrides])

    return _compose


def compose_stock(*overrides: str, config_dir: str = VERL_CONFIG_DIR, config_name: str = "ppo_trainer"):
    """What verl's stock ``main_ppo`` composes, hydra node included (the callback sees it)."""
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=["actor_rollout_ref.rollout.name=vllm", *overrides],
                       return_hydra_config=True)


def test_bpo_trainer_composes_over_verls_ppo_trainer(compose_bpo):
    cfg = compose_bpo("actor_rollout_ref.rollout.n=8", "bpo.fixed.k=4", "bpo.sandbox.name=textworld")
    assert cfg.algorithm.adv_estimator == "bpo"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "bpo_tree"
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"  # verl's own keys are all there
    bpo = prepare_config(cfg)
    assert bpo.fixed.k == 4 and bpo.sandbox.name == "textworld"
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(AGENT_LOOPS_YAML)
    assert bpo.for_estimator("bpo").root_width(8) == 4


def test_the_bpo_block_is_the_dataclass_schema(compose_bpo):
    """The yaml declares no bpo field: hydra takes the block from BPOConfig, defaults and types included."""
    cfg = compose_bpo()
    assert read_bpo_config(cfg.bpo) == BPOConfig()
    assert "bpo:" not in (Path(CONFIG_DIR) / "bpo_trainer.yaml").read_text().split("defaults:")[1].split("\n\n")[1]
    with pytest.raises(Exception, match="kk"):
        compose_bpo("bpo.kk=2")  # the schema is closed: a key it lacks cannot be overridden


def test_the_field_reference_lists_every_bpo_field_with_its_default():
    reference = (Path(CONFIG_DIR).parents[2] / "docs" / "training.md").read_text()
    table = reference.split("## The `bpo:` block")[1].split("\n\n")[1]
    documented = {}
    for line in table.splitlines()[2:]:
        names, defaults = line.split("|")[1:3]
        for name, default in zip(re.findall(r"`([a-z0-9_.]+)`", names), re.findall(r"`([^`]+)`", defaults)):
            documented[name] = default
    expected = {}
    for field in dataclasses.fields(BPOConfig):
        if field.default_factory is dataclasses.MISSING:
            expected[field.name] = field.default
        else:  # a block: its fields, dotted (bpo.fixed.k)
            block = field.default_factory()
            expected.update({f"{field.name}.{f.name}": getattr(block, f.name) for f in dataclasses.fields(block)})
    assert {"fixed.k", "learned.budget_unit", "ablation.epsilon", "sandbox.config"} <= set(expected)
    assert set(documented) == set(expected)
    for name, default in expected.items():
        shown = documented[name]
        assert shown == ("null" if default is None else str(default).lower() if isinstance(default, bool)
                         else str(default)), (name, shown, default)


# --- the dataclass itself: choices, blocks the allocation ignores, ablations, the hydra schema -----------------

SCORES = ["parent_turn_surprisal", "probe_surprisal", "next_token_entropy"]


@pytest.mark.parametrize("field,value,valid", [
    ("mode", "bogus", ["auto", "tree", "flat"]),
    ("allocation", "bogus", ["fixed", "learned"]),
    ("discount_weighting", "bogus", ["segment", "exact"]),
    ("fixed.score", "bogus", SCORES),
    ("fixed.score", "kept_turn_surprisal", SCORES),  # an ablation now (bpo.ablation.kept_turn_surprisal), not a score
    ("fixed.selector", "bogus", ["topB_wave", "quantile"]),
    ("learned.budget_unit", "bogus", ["leaves", "turns", "tokens"]),
])
def test_a_bad_choice_names_its_field_and_the_valid_values(field, value, valid):
    block, _, name = field.rpartition(".")
    raw = {block: {name: value}} if block else {name: value}
    if block == "learned":
        raw["allocation"] = "learned"
    with pytest.raises(ValueError, match=re.escape(f"bpo.{field}={value!r} is not valid; use one of {valid}")):
        BPOConfig.from_mapping(raw)


def test_choices_are_enums_that_compare_and_format_as_their_values():
    config = BPOConfig.from_mapping({"allocation": "learned", "learned": {"budget_unit": "tokens"}})
    assert config.allocation is Allocation.learned and config.allocation == "learned"
    assert config.learned.budget_unit is BudgetUnit.tokens and f"{config.learned.budget_unit}" == "tokens"
    assert BPOConfig().fixed.selector is Selector.topB_wave
    for kind in (Mode, Allocation, BudgetUnit, ForkScore, Selector, DiscountWeighting):
        assert all(member.name == member.value for member in kind)  # hydra matches an enum override by name


@pytest.mark.parametrize("raw,message", [
    ({"learned": {"max_leaves": 8}},
     "bpo.learned.max_leaves=8 is ignored under bpo.allocation=fixed; remove it or set bpo.allocation=learned"),
    ({"learned": {"budget_unit": "tokens"}},
     "bpo.learned.budget_unit=tokens is ignored under bpo.allocation=fixed; remove it or set bpo.allocation=learned"),
    ({"learned": {"warmup_trees": 0}},
     "bpo.learned.warmup_trees=0 is ignored under bpo.allocation=fixed; remove it or set bpo.allocation=learned"),
    ({"allocation": "learned", "fixed": {"k": 3}},
     "bpo.fixed.k=3 is ignored under bpo.allocation=learned; remove it or set bpo.allocation=fixed"),
    ({"allocation": "learned", "fixed": {"selector": "quantile"}},
     "bpo.fixed.selector=quantile is ignored under bpo.allocation=learned; remove it or set bpo.allocation=fixed"),
    ({"allocation": "learned", "ablation": {"kept_turn_surprisal": True}},
     "bpo.ablation.kept_turn_surprisal=true is ignored under bpo.allocation=learned"),
    ({"ablation": {"kept_turn_surprisal": True}, "fixed": {"score": "probe_surprisal"}},
     "bpo.fixed.score=probe_surprisal is ignored under bpo.ablation.kept_turn_surprisal=true"),
    ({"ablation": {"epsilon": 0.01}},
     "bpo.ablation.epsilon=0.01 is ignored without bpo.ablation.group_std=true"),
    ({"allocation": "learned", "learned": {"budget_unit": "leaves", "max_leaves": 8}},
     "bpo.learned.max_leaves=8 is ignored under bpo.learned.budget_unit=leaves"),
])
def test_a_field_the_run_would_ignore_is_refused(raw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BPOConfig.from_mapping(raw)


def test_each_block_reads_under_its_own_allocation():
    fixed = BPOConfig.from_mapping({"mode": "tree", "fixed": {"k": 3, "k0": 4}, "ablation": {
        "kept_turn_surprisal": True, "mean_incl_self": True, "group_std": True, "epsilon": 0.0}})
    assert fixed.root_width(8) == 4 and fixed.leaf_cap(8) == 8 and fixed.anticipating and not fixed.is_flat(8)
    learned = BPOConfig.from_mapping({"mode": "tree", "allocation": "learned",
                                      "learned": {"budget_unit": "tokens", "max_leaves": 16}})
    assert learned.leaf_cap(8) == 16 and learned.root_width(8) == 2 and not learned.anticipating
    assert BPOConfig(mode="tree", allocation="learned").leaf_cap(8) == 32  # turns by default, 4 x N leaves
    assert BPOConfig(mode="tree", allocation="learned", learned={"budget_unit": "leaves"}).leaf_cap(8) == 8


@pytest.mark.parametrize("raw,message", [
    ({"fixed": {"k": 1}}, "bpo.fixed.k=1 must be >= 2"),
    ({"fixed": {"k0": 0}}, "bpo.fixed.k0=0 must be >= 1 (or null for bpo.fixed.k)"),
    ({"fixed": {"probe_tokens": 0}}, "bpo.fixed.probe_tokens=0 must be >= 1"),
    ({"allocation": "learned", "learned": {"explore_share": 1.5}}, "bpo.learned.explore_share=1.5 must be in [0, 1]"),
    ({"allocation": "learned", "learned": {"max_leaves": 1}}, "bpo.learned.max_leaves=1 must be >= 2"),
    ({"allocation": "learned", "learned": {"cost_window": 0}}, "bpo.learned.cost_window=0 must be >= 1"),
    ({"ablation": {"group_std": True, "epsilon": -1.0}}, "bpo.ablation.epsilon=-1.0 must be >= 0"),
    ({"max_forks_per_path": 0}, "bpo.max_forks_per_path=0 must be >= 1 (or null for no cap)"),
    ({"learned": {"kk": 1}}, "unknown bpo.learned key(s) ['kk']; valid keys: ['budget_unit', 'cost_window',"),
    ({"ablation": {"baseline": "loo"}}, "unknown bpo.ablation key(s) ['baseline']; valid keys: ['epsilon',"),
    ({"sandbox": {"nme": "smoke"}}, "unknown bpo.sandbox key(s) ['nme']; valid keys: ['config', 'name']"),
    ({"budget": "turns"}, "unknown bpo config key(s) ['budget']; valid keys: ['ablation', 'allocation',"),
])
def test_range_checks_and_unknown_keys_name_the_dotted_field(raw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BPOConfig.from_mapping(raw)


def schema_with(*overrides: str):
    """The registered ``bpo: schema`` node with hydra-style dotted ``overrides`` merged in (what composing does)."""
    schema = ConfigStore.instance().load("bpo/schema.yaml").node
    return OmegaConf.merge(schema, OmegaConf.from_dotlist(list(overrides)))


@pytest.mark.parametrize("override,valid", [("allocation=bogus", "fixed, learned"),
                                            ("fixed.selector=bogus", "topB_wave, quantile"),
                                            ("learned.budget_unit=bogus", "leaves, turns, tokens")])
def test_the_hydra_schema_refuses_a_value_outside_the_enum(override, valid):
    with pytest.raises(ValidationError, match=re.escape(f"Invalid value 'bogus', expected one of [{valid}]")):
        schema_with(override)


def test_the_hydra_schema_takes_nested_choices_into_the_dataclass():
    node = schema_with("allocation=learned", "learned.budget_unit=tokens", "learned.max_leaves=16")
    config = read_bpo_config(node)
    assert config.allocation is Allocation.learned and config.learned.budget_unit is BudgetUnit.tokens
    assert config.learned.max_leaves == 16 and config == BPOConfig(
        allocation="learned", learned=LearnedAllocation(budget_unit="tokens", max_leaves=16))
    with pytest.raises(ValueError, match=r"bpo\.learned\.budget_unit=tokens is ignored under bpo\.allocation=fixed"):
        read_bpo_config(schema_with("learned.budget_unit=tokens"))


def test_grpo_baseline_gets_flat_groups_under_auto(compose_bpo):
    cfg = compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8")
    bpo = prepare_config(cfg)
    assert bpo.for_estimator("grpo").is_flat(8) and bpo.for_estimator("grpo").root_width(8) == 8


# --- bad settings: each fails in prepare_config, before Ray, naming the key and the fix -------------------------

def fast_tier(cases: list, keep: int) -> list:
    """The first ``keep`` cases run in the fast tier, the rest are `slow`: each composes verl's whole trainer config
    (about half a second of CPU), and a few cases of a rule family are enough for a quick check."""
    return [case if i < keep else pytest.param(*case, marks=pytest.mark.slow) for i, case in enumerate(cases)]


BAD_SETTINGS = [
    (["actor_rollout_ref.rollout.n=1"], r"actor_rollout_ref\.rollout\.n=1 is the number of leaves"),
    (["actor_rollout_ref.rollout.n=4", "bpo.fixed.k0=9"],
     r"bpo\.fixed\.k0=9 exceeds actor_rollout_ref\.rollout\.n=4.*bpo\.fixed\.k0 <= 4"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.loss_agg_mode=token-mean"],
     "loss_agg_mode=token-mean reweights"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"],
     "set it to bpo_tree"),
    (["actor_rollout_ref.rollout.n=4", "bpo.mode=flat"], "use adv_estimator=rloo"),
    (["actor_rollout_ref.rollout.n=4", "+bpo.kk=2"], r"unknown bpo config key\(s\) \['kk'\]"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=True"], "use_kl_in_reward=True"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.entropy_coeff=0.01"], "entropy_coeff=0.01"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.loss_scale_factor=null"], "loss_scale_factor=null"),
    (["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.calculate_log_probs=False"],
     "calculate_log_probs=False"),
    (["actor_rollout_ref.rollout.n=4", "bpo.sandbox.name=nosuch"],
     r"bpo\.sandbox\.name='nosuch' is not a registered sandbox; choose one of"),
    (["actor_rollout_ref.rollout.n=4", "+bpo.sandbox.config.unknown_key=1"],
     r"bpo\.sandbox\.config: unknown key\(s\) \['unknown_key'\] for sandbox 'smoke'; valid keys"),
    (["actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=bpoo"], "Unknown advantage estimator"),
    (["actor_rollout_ref.rollout.n=4", "bpo.learned.max_leaves=8"],
     r"bpo\.learned\.max_leaves=8 is ignored under bpo\.allocation=fixed; remove it or set bpo\.allocation=learned"),
    (["actor_rollout_ref.rollout.n=4", "+bpo.fixed.kk=2"],
     r"unknown bpo\.fixed key\(s\) \['kk'\]; valid keys: \['k', 'k0',"),
    (["actor_rollout_ref.rollout.n=4", "data.train_files=/nonexistent/train.parquet"],
     r"data\.train_files=/nonexistent/train\.parquet does not exist .*point data\.train_files at the file"),
    (["actor_rollout_ref.rollout.n=4", "data.val_files=[/nonexistent/val.parquet]"],
     r"data\.val_files=/nonexistent/val\.parquet does not exist"),
    (["actor_rollout_ref.rollout.n=4", "bpo.sandbox.name=swebench", "bpo.step_timeout_s=60"],
     r"bpo\.step_timeout_s=60 is shorter than one step of sandbox 'swebench' may take within its own limits "
     r"\(930 s with \{'command_timeout_s': 30\.0, 'grading_timeout_s': 300\.0\}.*Set bpo\.step_timeout_s >= 930"),
]


@pytest.mark.parametrize("overrides,message", fast_tier(BAD_SETTINGS, 6))
def test_bad_settings_fail_before_anything_starts(compose_bpo, overrides, message):
    cfg = compose_bpo(*overrides)
    with pytest.raises(ValueError, match=message):
        prepare_config(cfg)


def test_step_timeout_that_fits_the_sandbox_passes(compose_bpo):
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", "bpo.sandbox.name=swebench", "bpo.step_timeout_s=1000")
    assert prepare_config(cfg).step_timeout_s == 1000


def write_rows(path: Path, sandbox: str, config: dict, agent_name: str = "bpo_tree") -> Path:
    """Rows whose sandbox spec is written as given (sandbox_rows(render=False) does not build the sandbox)."""
    rows = sandbox_rows("smoke", [{"task_id": 0}, {"task_id": 1}], {"length": 3}, agent_name=agent_name,
                        render=False)
    rows[1]["extra_info"]["sandbox"] = json.dumps({"name": sandbox, "config": config})
    return write_sandbox_dataset(path, rows)


@pytest.mark.parametrize(
    "sandbox,config,extra,message",
    [
        ("nosuch", {}, [], r"extra_info\.sandbox of row 1 of data\.(train|val)_files=.*rows\.parquet: "
                           r"bpo\.sandbox\.name='nosuch' is not a registered sandbox"),
        ("smoke", {"unknown_key": 1}, [], r"row 1 of .*unknown key\(s\) \['unknown_key'\] for sandbox 'smoke'"),
        ("swebench", {"grading_timeout_s": 600}, ["bpo.step_timeout_s=1000"],
         r"bpo\.step_timeout_s=1000 is shorter .* 'swebench' .*\(1830 s .*from extra_info\.sandbox of row 1"),
    ],
)
def test_the_sandbox_of_every_dataset_row_is_checked(compose_bpo, tmp_path, sandbox, config, extra, message):
    rows = write_rows(tmp_path / "rows.parquet", sandbox, config)
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows), *extra)
    with pytest.raises(ValueError, match=message):
        prepare_config(cfg)


def test_rows_of_another_agent_loop_are_refused_for_bpo_only(compose_bpo, tmp_path):
    rows = write_rows(tmp_path / "rows.parquet", "smoke", {}, agent_name="tool_agent")
    with pytest.raises(ValueError, match=r"row 0 has agent_name='tool_agent'.*agent_name=bpo_tree"):
        prepare_config(compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows)))
    prepare_config(compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", *data_overrides(rows)))


# --- verl's stock main_ppo ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,hooked",
    [
        (["python", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=bpo"], True),
        (["python", "/x/verl/trainer/main_ppo.py", "--config-name=mine"], True),
        (["python", "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo"], True),  # the callback decides
        (["python", "-m", "verl_bpo.main", "algorithm.adv_estimator=bpo"], False),
        (["/ray/default_worker.py", "--node-ip-address=1"], False),
    ],
)
def test_the_hook_adds_the_callback_to_stock_main_ppo_only(monkeypatch, argv, hooked):
    monkeypatch.delenv(stock_launch.STOCK_LAUNCH_ENV, raising=False)
    args = list(argv[1:])
    assert stock_launch.hook_stock_main_ppo(argv, args) is hooked
    assert (stock_launch.CALLBACK_OVERRIDE in args) is hooked
    stock_launch.hook_stock_main_ppo(argv, args)
    assert args.count(stock_launch.CALLBACK_OVERRIDE) == int(hooked)  # idempotent


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_the_hook_can_be_turned_off(monkeypatch, value):
    monkeypatch.setenv(stock_launch.STOCK_LAUNCH_ENV, value)
    args = ["algorithm.adv_estimator=bpo"]
    assert not stock_launch.hook_stock_main_ppo(["python", "-m", "verl.trainer.main_ppo", *args], args)
    assert args == ["algorithm.adv_estimator=bpo"]


def test_bpo_defaults_replace_verls_defaults_only(data):
    """Where the stock config holds verl's default, the bpo_trainer.yaml value applies (the keys verl_bpo.main
    starts from); the verl defaults the hook compares with are verl's composed ppo_trainer."""
    verl_default = compose_stock()
    for key in stock_launch.bpo_defaults():
        assert OmegaConf.select(verl_default, key) == OmegaConf.select(stock_launch.verl_defaults(), key), key


def test_stock_cli_config_is_wired_for_bpo(monkeypatch, data):
    cfg = compose_stock("algorithm.adv_estimator=bpo", "actor_rollout_ref.rollout.n=4", "+bpo.fixed.k=2",
                        "data.max_response_length=96", ONE_MINIBATCH, *data_overrides(data))
    stock_launch.StockLaunch().on_run_start(cfg)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.trainer.v1.trainer_mode == "bpo"
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm" and actor.loss_scale_factor == 96
    assert rollout.calculate_log_probs and rollout.agent.default_agent_loop == "bpo_tree"
    assert rollout.agent.agent_loop_config_path == str(AGENT_LOOPS_YAML)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_BPO_TRAINER == "1"
    assert read_bpo_config(cfg.bpo).fixed.k == 2


def test_the_trainer_mode_name_builds_bpo_trainer_in_sync_mode():
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    from verl_bpo.integration.trainer import TRAINER_MODE, BPOTrainer

    assert get_trainer_cls(TRAINER_MODE) is BPOTrainer and issubclass(BPOTrainer, PPOTrainerSync)


@pytest.mark.slow
def test_the_plugin_registers_bpo_trainer_in_the_workers_of_a_stock_bpo_run_only():
    probe = ("import verl; from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY; "
             "print('bpo' in TRAINER_REGISTRY)")
    for value, registered in (("1", "True"), ("", "False")):
        env = {**os.environ, stock_launch.TRAINER_ENV: value, "VERL_PLATFORM": "cpu"}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert out.stdout.strip().splitlines()[-1] == registered, out.stderr[-3000:]


def test_stock_cli_keys_are_never_replaced(data):
    cfg = compose_stock("algorithm.adv_estimator=bpo", "actor_rollout_ref.rollout.n=4",
                        "actor_rollout_ref.actor.loss_agg_mode=token-mean", *data_overrides(data))
    with pytest.raises(SystemExit, match=r"verl-bpo: actor_rollout_ref\.actor\.loss_agg_mode=token-mean reweights"):
        stock_launch.StockLaunch().on_run_start(cfg)


def test_stock_runs_without_bpo_are_left_alone(data):
    cfg = compose_stock("algorithm.adv_estimator=grpo", "data.train_files=/nonexistent.parquet")
    before = copy.deepcopy(OmegaConf.to_container(cfg))
    callback = stock_launch.StockLaunch()
    callback.on_run_start(cfg)
    callback.on_job_start(cfg, task_function=None)
    assert OmegaConf.to_container(cfg) == before


BPO_YAML = """\
hydra:
  searchpath:
    - pkg://verl.trainer.config
defaults:
  - ppo_trainer
  - _self_
algorithm:
  adv_estimator: bpo
actor_rollout_ref:
  rollout:
    n: 4
bpo:
  fixed:
    k: 2
  step_timeout_s: {timeout}
  sandbox:
    name: {sandbox}
"""


def write_yaml(folder: Path, sandbox: str = "smoke", timeout: float = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_bpo.yaml").write_text(BPO_YAML.format(sandbox=sandbox, timeout=timeout))
    return folder


def test_stock_yaml_config_is_wired_for_bpo(tmp_path, data):
    cfg = compose_stock(ONE_MINIBATCH, *data_overrides(data), config_dir=str(write_yaml(tmp_path)),
                        config_name="my_bpo")
    assert cfg.algorithm.adv_estimator == "bpo"
    stock_launch.StockLaunch().on_run_start(cfg)
    assert cfg.trainer.v1.trainer_mode == "bpo" and cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "bpo_tree"


def test_stock_multirun_is_refused_rather_than_run_unwired(data):
    cfg = compose_stock("algorithm.adv_estimator=bpo", *data_overrides(data))
    with pytest.raises(SystemExit, match="verl_bpo.main --multirun"):
        stock_launch.StockLaunch().on_job_start(cfg, task_function=None)


# --- as real commands: each bad setting fails within seconds, before Ray starts ---------------------------------

STOCK = ["-m", "verl.trainer.main_ppo"]
BPO_MAIN = ["-m", "verl_bpo.main"]


def run_command(args: list[str], cwd: Path):
    env = {k: v for k, v in os.environ.items() if k != stock_launch.STOCK_LAUNCH_ENV}
    start = time.monotonic()
    out = subprocess.run([sys.executable, *args, "actor_rollout_ref.rollout.name=vllm"], capture_output=True,
                         text=True, timeout=300, cwd=cwd, env=env)
    return out, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.parametrize(
    "entry,overrides,message",
    [
        (STOCK, ["algorithm.adv_estimator=bpo", "+bpo.sandbox.name=nosuch"],
         r"bpo\.sandbox\.name='nosuch' is not a registered sandbox"),
        (BPO_MAIN, ["+bpo.sandbox.config.unknown_key=1"], r"unknown key\(s\) \['unknown_key'\] for sandbox 'smoke'"),
        (STOCK, ["algorithm.adv_estimator=bpo", "data.train_files=missing.parquet"],
         r"data\.train_files=missing\.parquet does not exist"),
        (BPO_MAIN, ["data.val_files=missing.parquet"], r"data\.val_files=missing\.parquet does not exist"),
        (BPO_MAIN, ["actor_rollout_ref.rollout.n=1"], r"actor_rollout_ref\.rollout\.n=1 is the number of leaves"),
        ("yaml", [], r"bpo\.step_timeout_s=60 is shorter than one step of sandbox 'swebench'"),
    ],
)
def test_bad_settings_fail_within_seconds_before_ray_as_real_commands(tmp_path, data, entry, overrides, message):
    if entry == "yaml":
        entry = [*STOCK, f"--config-path={write_yaml(tmp_path / 'conf', 'swebench', 60)}", "--config-name=my_bpo"]
    leaves = "actor_rollout_ref.rollout.n=4"  # a case that sets N comes later and wins
    out, seconds = run_command([*entry, *data_overrides(data), leaves, *overrides], tmp_path)
    assert out.returncode != 0, out.stdout[-2000:]
    assert re.search(message, out.stderr), out.stderr[-3000:]
    assert "verl-bpo:" in out.stderr  # our message, not a traceback from deep inside a worker
    assert "ray init" not in (out.stdout + out.stderr).lower()  # run_ppo prints "ray init kwargs" first
    assert seconds < 90, f"took {seconds:.0f} s"


# --- rows, worker-side settings, mini-batches, KL control, runtimes: refused before Ray --------------------------


def rows_file(path: Path, *edits, sandbox: str = "smoke", config: dict | None = None,
              tasks: list | None = None) -> Path:
    """Rows as verl_bpo.data writes them (placeholder prompts), then each ``edit(extra_info)`` applied to row i."""
    tasks = tasks if tasks is not None else [{"task_id": 0}, {"task_id": 1}]
    rows = sandbox_rows(sandbox, tasks, {"length": 3} if config is None else config, render=False)
    for row, edit in zip(rows, edits):
        edit(row["extra_info"])
    return write_sandbox_dataset(path, rows)


def keep(extra):
    pass


def no_sandbox(extra):
    del extra["sandbox"]


def no_task(extra):
    del extra["task"]


def task(value):
    def edit(extra):
        extra["task"] = value if isinstance(value, str) else json.dumps(value)

    return edit


@pytest.mark.parametrize(
    "edits,extra,message",
    fast_tier([
        ([keep, no_sandbox], [],
         r"data\.(train|val)_files=.*rows\.parquet: row 1 has no extra_info\.sandbox, so the bpo_tree agent loop "
         r"would run it in bpo\.sandbox, left at its default \('smoke' with no config\).*verl_bpo\.data.*"
         r"set bpo\.sandbox\.name"),
        ([no_task], [], r"rows\.parquet: row 0 has no extra_info\.task \(or an empty one\).*verl_bpo\.data"),
        ([keep, task({})], [], r"row 1 has no extra_info\.task \(or an empty one\)"),
        ([keep, task("{not json")], [], r"row 1: extra_info\.task is not JSON"),
        ([keep, task({"id": 1})], [],
         r"row 1: extra_info\.task does not fit sandbox 'smoke' \(its extra_info\.sandbox\): sandbox 'smoke' needs "
         r"a task with \['task_id'\], got keys \['id'\]"),
        ([keep, task({"task_id": "one"})], [], r"row 1: .*task_id='one' is not an integer"),
        ([keep, task({"task_id": 8})], [], r"row 1: .*task_id=8 is outside \[0, 8\)"),
        ([keep, task([1, 2])], [], r"row 1: .*the task must be a non-empty mapping"),
        # bpo.sandbox set explicitly: the fallback is taken, and the row's task must fit that sandbox
        ([keep, no_sandbox], ["bpo.sandbox.name=signpost", "+bpo.sandbox.config.num_tasks=1"],
         r"row 1: extra_info\.task does not fit sandbox 'signpost' \(bpo\.sandbox\): .*task_id=1 is outside "
         r"\[0, 1\)"),
        ([no_sandbox, no_sandbox], ["bpo.sandbox.name=webshop"],
         r"row 0: extra_info\.task does not fit sandbox 'webshop' \(bpo\.sandbox\): .*\['goal_index'\]"),
    ], 4),
)
def test_rows_the_tree_loop_cannot_run_are_refused(compose_bpo, tmp_path, edits, extra, message):
    rows = rows_file(tmp_path / "rows.parquet", *edits)
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows), *extra)
    with pytest.raises(ValueError, match=message):
        prepare_config(cfg)


def budget(value):
    def edit(extra):
        extra["bpo_budget"] = value

    return edit


LEARNED_TOKENS = ("bpo.allocation=learned", "bpo.learned.budget_unit=tokens")


@pytest.mark.parametrize(
    "value,extra,message",
    [
        (0.0, LEARNED_TOKENS, r"rows\.parquet: row 1: extra_info\.bpo_budget of uid row 1 must be a positive number"),
        (-3.0, LEARNED_TOKENS, r"row 1: extra_info\.bpo_budget .* must be a positive number .* got -3\.0"),
        ("96", LEARNED_TOKENS, r"row 1: extra_info\.bpo_budget .* must be a positive number .* got '96'"),
        (50.0, (), r"rows\.parquet: row 1 has extra_info\.bpo_budget=50, a tree budget, but bpo\.allocation=fixed "
                   r"grows exactly actor_rollout_ref\.rollout\.n leaves per tree and would ignore it; set "
                   r"bpo\.allocation=learned"),
    ],
)
def test_a_bad_row_budget_is_refused(compose_bpo, tmp_path, value, extra, message):
    rows = rows_file(tmp_path / "rows.parquet", keep, budget(value))
    with pytest.raises(ValueError, match=message):
        prepare_config(compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows), *extra))


def test_row_budgets_pass_for_learned_trees_and_flat_baselines(compose_bpo, tmp_path):
    """A learned tree reads a row's budget (rows with and without one mix in a file); flat groups ignore it, so a
    GRPO run may train on the BPO run's rows whatever its allocation."""
    rows = rows_file(tmp_path / "rows.parquet", keep, budget(64.0))
    prepare_config(compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows), *LEARNED_TOKENS))
    prepare_config(compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", *data_overrides(rows)))


def test_rows_carry_their_budgets_through_parquet(tmp_path):
    import pandas as pd

    rows = sandbox_rows("smoke", [{"task_id": 0}, {"task_id": 1}, {"task_id": 2}], {"length": 3}, render=False,
                        budgets=[12, None, 40.5])
    back = pd.read_parquet(write_sandbox_dataset(tmp_path / "rows.parquet", rows))["extra_info"].tolist()
    assert [e["bpo_budget"] for e in back[::2]] == [12.0, 40.5]
    assert back[1].get("bpo_budget") is None  # a row without one: null in a file whose other rows carry one
    assert "bpo_budget" not in sandbox_rows("smoke", [{"task_id": 0}], {"length": 3}, render=False)[0]["extra_info"]
    with pytest.raises(ValueError, match=r"2 budgets for 3 tasks"):
        sandbox_rows("smoke", [{"task_id": i} for i in range(3)], {"length": 3}, render=False, budgets=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"the budget of task 1 must be a positive number"):
        sandbox_rows("smoke", [{"task_id": 0}, {"task_id": 1}], {"length": 3}, render=False, budgets=[1.0, 0])


def test_rows_without_a_sandbox_run_in_an_explicit_bpo_sandbox_that_takes_their_tasks(compose_bpo, tmp_path):
    rows = rows_file(tmp_path / "rows.parquet", no_sandbox, no_sandbox)
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows), "bpo.sandbox.name=signpost")
    assert prepare_config(cfg).sandbox.name == "signpost"
    # a config of the default sandbox is a choice too
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", *data_overrides(rows), "+bpo.sandbox.config.length=3")
    assert prepare_config(cfg).sandbox.config == {"length": 3}


def test_rows_of_other_agent_loops_keep_their_own_sandbox_and_task(compose_bpo, tmp_path):
    """A grpo run through another agent loop reads neither extra_info.sandbox nor extra_info.task."""
    rows = rows_file(tmp_path / "rows.parquet", lambda e: (no_sandbox(e), no_task(e)), no_sandbox)
    table = pd_read(rows)
    table["agent_name"] = "single_turn_agent"
    table.to_parquet(rows)
    prepare_config(compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                               *data_overrides(rows)))
    rows = rows_file(tmp_path / "default.parquet", no_sandbox, no_task)
    table = pd_read(rows).drop(columns=["agent_name"])
    table.to_parquet(rows)
    prepare_config(compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                               "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",
                               *data_overrides(rows)))
    with pytest.raises(ValueError, match=r"row 0 has no extra_info\.sandbox"):  # the tree loop runs them
        prepare_config(compose_bpo("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                                   *data_overrides(rows)))


def pd_read(path):
    import pandas as pd

    return pd.read_parquet(path)


MORE_BAD_SETTINGS = [
    (["bpo.fixed.score=next_token_entropy"],
     r"bpo\.fixed\.score=next_token_entropy needs .* verl's vLLM/SGLang servers "
     r".*bpo\.fixed\.score=parent_turn_surprisal"),
    (["algorithm.adv_estimator=grpo", "bpo.fixed.score=next_token_entropy"], r"bpo\.fixed\.score=next_token_entropy"),
    (["algorithm.gamma=0"], r"algorithm\.gamma=0 .*set it in \(0, 1\]"),
    (["algorithm.gamma=1.5"], r"algorithm\.gamma=1\.5"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive"],
     r"algorithm\.kl_ctrl\.type=adaptive with algorithm\.use_kl_in_reward=True .*set algorithm\.kl_ctrl\.type=fixed"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=256"],
     r"actor_rollout_ref\.actor\.ppo_mini_batch_size=256 with data\.train_batch_size=1024: BPO needs one optimizer "
     r"step per batch .*set actor_rollout_ref\.actor\.ppo_mini_batch_size=1024"),
    (["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "actor_rollout_ref.actor.shuffle=True"], r"ppo_mini_batch_size=4 with data\.train_batch_size=8"),
    # packed trees (bpo.packed, the default)
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     r"actor_rollout_ref\.actor\.ulysses_sequence_parallel_size=2: a packed tree.*set bpo\.packed=false"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     r"actor_rollout_ref\.actor\.policy_loss\.loss_mode=gspo: .*positively homogeneous.*set bpo\.packed=false"),
    (["++actor_rollout_ref.model.override_config.attn_implementation=eager"],
     r"attn_implementation=eager: .*sdpa or flash_attention_2"),
    (["++actor_rollout_ref.model.override_config.attn_implementation=flex_attention"],
     r"attn_implementation=flex_attention: .*sdpa or flash_attention_2.*set bpo\.packed=false"),
]


@pytest.mark.parametrize("overrides,message", fast_tier(MORE_BAD_SETTINGS, 4))
def test_settings_the_workers_or_the_trainer_would_refuse_late_fail_now(compose_bpo, overrides, message):
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", *overrides)
    with pytest.raises(ValueError, match=message):
        prepare_config(cfg)


@pytest.mark.parametrize("overrides", [
    ["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=fixed"],
    ["algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.type=adaptive"],  # no controller is built
    ["actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_epochs=2"],  # one mini-batch: harmless
    ["trainer.balance_batch=True"],  # v1 ignores it (and balances anyway): harmless with one mini-batch
    ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "bpo.packed=false"],  # leaf rows: any SP
    ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
     "algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=True"],  # flat groups: verl's own rules
])
def test_safe_settings_pass(compose_bpo, overrides):
    prepare_config(compose_bpo("actor_rollout_ref.rollout.n=4", *overrides))


def swe_rows(path: Path, config: dict) -> Path:
    return rows_file(path, sandbox="swebench", config=config, tasks=[{"instance_id": "x__y-1"}])


def test_a_missing_sandbox_runtime_is_refused_naming_this_node(compose_bpo, tmp_path, monkeypatch):
    import socket

    from sandbox_adapters.swebench import confine

    monkeypatch.setattr(confine, "bwrap_path", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rows = swe_rows(tmp_path / "swe.parquet", {})
    base = ["actor_rollout_ref.rollout.n=4", "bpo.step_timeout_s=1000", *data_overrides(rows)]
    with pytest.raises(ValueError, match=rf"extra_info\.sandbox of row 0 of .*swe\.parquet: sandbox 'swebench' "
                                         rf"cannot run on node '{re.escape(socket.gethostname())}': backend=local "
                                         r"needs bubblewrap \(`bwrap`; .*apt-get install bubblewrap\)"):
        prepare_config(compose_bpo(*base))
    # several nodes, or a Ray cluster of its own: the workers run elsewhere and check at their start
    prepare_config(compose_bpo(*base, "trainer.nnodes=2"))
    prepare_config(compose_bpo(*base, "+ray_kwargs.ray_init.address=10.0.0.1:6379"))
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    prepare_config(compose_bpo(*base))


def test_a_missing_docker_engine_is_refused(compose_bpo, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rows = swe_rows(tmp_path / "swe.parquet", {"backend": "docker", "docker_binary": "/nonexistent/docker"})
    cfg = compose_bpo("actor_rollout_ref.rollout.n=4", "bpo.step_timeout_s=1000", *data_overrides(rows))
    with pytest.raises(ValueError, match=r"sandbox 'swebench' cannot run on node .*backend=docker needs a Docker "
                                         r"engine answering `/nonexistent/docker info`"):
        prepare_config(cfg)


def test_the_fallback_sandbox_runtime_is_checked_only_when_a_row_may_use_it(compose_bpo, tmp_path, monkeypatch):
    from sandbox_adapters.swebench import confine

    monkeypatch.setattr(confine, "bwrap_path", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    swe = ["bpo.sandbox.name=swebench", "bpo.step_timeout_s=1000"]
    prepare_config(compose_bpo("actor_rollout_ref.rollout.n=4", *swe))  # every row names smoke
    remote = ["data.val_files=hdfs://cluster/val.parquet"]  # not read here: its rows may fall back
    with pytest.raises(ValueError, match=r"^bpo\.sandbox: sandbox 'swebench' cannot run on node"):
        prepare_config(compose_bpo("actor_rollout_ref.rollout.n=4", *swe, *remote))


def test_registry_checks_for_workers():
    """What an agent-loop worker calls at start: check_runtime(name, config) for each sandbox it may build."""
    import socket

    from sandbox_adapters.registry import SandboxRuntimeMissing, check_runtime, check_task

    check_runtime("smoke", {"length": 3})
    with pytest.raises(SandboxRuntimeMissing, match=re.escape(socket.gethostname())):
        check_runtime("swebench", {"backend": "docker", "docker_binary": "/nonexistent/docker"})
    check_task("smoke", {"task_id": 7})
    check_task("textworld", {"game": "/x.z8"})
    with pytest.raises(ValueError, match=r"\['game or task_id'\]"):
        check_task("alfworld", {"name": "x"})
    with pytest.raises(ValueError, match="non-empty mapping"):
        check_task("tabular", {})
