"""The GPU recipes (recipes/<benchmark>/run_*.sh) and their data preparation (python -m verl_bpo.data.prepare).

No GPU, no Ray: each script runs with VERL_BPO_DRY_RUN=1, which prints its command one argument per line; the
overrides are composed with hydra on verl_bpo/integration/config/bpo_trainer.yaml and go through the same checks as
`python -m verl_bpo.main` (prepare_config, then verl's validate_config). The prepare-data commands run end to end on
this project's generated smoke data.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl_bpo.integration
from verl_bpo.data import prepare as prepare_data
from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.demo import cpu_demo
from verl_bpo.integration.settings import AGENT_LOOPS_YAML, prepare_config, register_schema

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CONFIG_DIR = str(Path(verl_bpo.integration.__file__).parent / "config")
register_schema()

BENCHMARKS = {"webshop": 15, "alfworld": 50, "swebench": 30}  # benchmark -> bpo.max_turns
MODELS = {"qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct"}
ESTIMATORS = ("bpo", "grpo", "rloo")
SCRIPTS = [RECIPES / b / f"run_{e}_{m}.sh" for b, m, e in itertools.product(BENCHMARKS, MODELS, ESTIMATORS)]
# What a comparison may differ in: the estimator, and the experiment name that says which estimator it is.
ESTIMATOR_KEYS = {"algorithm.adv_estimator", "trainer.experiment_name"}
# The fast tier composes each benchmark's BPO recipe and compares the estimators on one model (a second or more per
# composition); the other combinations are `slow`.
FAST_MODEL = next(iter(MODELS))
FAST_SCRIPTS = {RECIPES / b / f"run_bpo_{FAST_MODEL}.sh" for b in BENCHMARKS}
RECIPE_ENV = ("DATA_DIR", "MODEL_PATH", "PYTHON", "PROJECT_NAME", "NNODES", "N_GPUS_PER_NODE", "ROLLOUT_TP")


def dry_run(script: Path, *extra: str, **env: str) -> list[str]:
    """The command a recipe would run: [python, -m, verl_bpo.main, overrides...]."""
    base = {k: v for k, v in os.environ.items() if k not in RECIPE_ENV}
    out = subprocess.run(["bash", str(script), *extra], env={**base, "VERL_BPO_DRY_RUN": "1", **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.fixture(scope="module")
def recipe_home(tmp_path_factory) -> Path:
    """A HOME whose data/bpo/<benchmark>/{train,val}.parquet exist (placeholder rows with the recipe's sandbox
    settings), since the checks before Ray read the datasets a recipe points at."""
    home = tmp_path_factory.mktemp("home")
    tasks = {"webshop": [{"goal_index": 0}], "alfworld": [{"game": "/nonexistent/game.tw-pddl"}],
             "swebench": [{"instance_id": "x__y-1"}]}
    for benchmark, (_, _, config) in prepare_data.BENCHMARKS.items():
        for split in ("train", "val"):
            write_sandbox_dataset(home / "data" / "bpo" / benchmark / f"{split}.parquet",
                                  sandbox_rows(benchmark, tasks[benchmark], config, split=split, render=False))
    return home


def overrides_of(script: Path, *extra: str, **env: str) -> list[str]:
    command = dry_run(script, *extra, **env)
    assert command[:3] == ["python3", "-m", "verl_bpo.main"], command[:3]
    return command[3:]


def compose_recipe(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="bpo_trainer", overrides=overrides)


def flat(cfg) -> dict[str, object]:
    """Unresolved config as {dotted key: value} (interpolations compare as their text)."""
    out: dict[str, object] = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


def test_every_benchmark_has_bpo_grpo_rloo_for_both_models():
    found = sorted(RECIPES.glob("*/run_*.sh"))
    assert found == sorted(SCRIPTS)
    for script in SCRIPTS:
        assert os.access(script, os.X_OK), f"{script} is not executable"
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        # the shared settings live in the benchmark's common.sh, not in the run scripts
        assert len(script.read_text().splitlines()) < 15


@pytest.mark.parametrize("script", [pytest.param(s, marks=() if s in FAST_SCRIPTS else pytest.mark.slow)
                                    for s in SCRIPTS], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_composes_validates_and_resolves_to_its_components(script, recipe_home):
    benchmark, estimator = script.parent.name, script.stem.split("_")[1]
    model_tag = script.stem.split("_", 2)[2]
    cfg = compose_recipe(overrides_of(script, HOME=str(recipe_home)))
    bpo = prepare_config(cfg)  # what `python -m verl_bpo.main` checks before Ray starts

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))

    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    assert cfg.algorithm.adv_estimator == estimator
    # baselines run through the same tree agent loop, which gives them flat groups under bpo.mode=auto
    assert rollout.agent.default_agent_loop == "bpo_tree"
    assert rollout.agent.agent_loop_config_path == str(AGENT_LOOPS_YAML)
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert actor.loss_scale_factor == cfg.data.max_response_length
    assert bpo.mode == "auto" and bpo.fixed.k == 2 and bpo.max_turns == BENCHMARKS[benchmark]
    assert bpo.sandbox.name == benchmark
    assert rollout.n == 8 and rollout.name == "vllm" and rollout.enable_prefix_caching
    resolved = bpo.for_estimator(estimator)
    assert resolved.root_width(rollout.n) == (2 if estimator == "bpo" else 8)  # a tree, or N independent episodes
    assert resolved.max_turns == BENCHMARKS[benchmark]

    assert actor.optim.lr == 1e-6 and not actor.use_kl_loss
    assert cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "low_var_kl"
    assert cfg.actor_rollout_ref.model.path == MODELS[model_tag]
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.trainer.project_name == f"verl_bpo_{benchmark}"
    assert cfg.trainer.experiment_name == f"{estimator}_{model_tag}_n8"
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.nnodes == 1
    assert cfg.data.train_files.endswith(f"data/bpo/{benchmark}/train.parquet")
    # a whole sequence fits one (sequence-parallel) micro batch
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert actor.ppo_max_token_len_per_gpu * actor.ulysses_sequence_parallel_size >= seq_len
    # the episode limit written into the prepared rows matches the recipe's turn limit
    assert prepare_data.BENCHMARKS[benchmark][2]["max_steps"] == bpo.max_turns


@pytest.mark.parametrize("benchmark,model", [pytest.param(b, m, marks=() if m == FAST_MODEL else pytest.mark.slow)
                                             for b, m in itertools.product(BENCHMARKS, MODELS)])
def test_bpo_and_baselines_differ_only_in_the_estimator(benchmark, model):
    overrides = {e: overrides_of(RECIPES / benchmark / f"run_{e}_{model}.sh") for e in ESTIMATORS}
    configs = {e: flat(compose_recipe(o)) for e, o in overrides.items()}
    for estimator in ("grpo", "rloo"):
        changed = {line.split("=", 1)[0] for line in set(overrides["bpo"]) ^ set(overrides[estimator])}
        assert changed == ESTIMATOR_KEYS
        assert len(overrides["bpo"]) == len(overrides[estimator])
        a, b = configs["bpo"], configs[estimator]
        assert a.keys() == b.keys()
        assert {k for k in a if a[k] != b[k]} == ESTIMATOR_KEYS
    compute = ("actor_rollout_ref.rollout.n", "data.train_batch_size", "trainer.total_training_steps",
               "data.max_prompt_length", "data.max_response_length", "bpo.max_turns", "bpo.max_tokens_per_turn")
    assert len({tuple(c[k] for k in compute) for c in configs.values()}) == 1


@pytest.mark.parametrize("benchmark", [pytest.param(b, marks=() if i == 0 else pytest.mark.slow)
                                       for i, b in enumerate(BENCHMARKS)])
def test_the_two_models_share_every_setting_but_the_model(benchmark):
    qwen, llama = (flat(compose_recipe(overrides_of(RECIPES / benchmark / f"run_bpo_{m}.sh"))) for m in MODELS)
    assert {k for k in qwen if qwen[k] != llama[k]} == {"actor_rollout_ref.model.path", "trainer.experiment_name"}


def test_environment_and_extra_overrides_reach_the_command(tmp_path):
    script = RECIPES / "alfworld" / "run_bpo_qwen2.5-7b.sh"
    overrides = overrides_of(script, "trainer.total_training_steps=3", "bpo.fixed.k=4",
                             MODEL_PATH="/models/qwen", DATA_DIR=str(tmp_path), N_GPUS_PER_NODE="4")
    assert overrides[-2:] == ["trainer.total_training_steps=3", "bpo.fixed.k=4"]  # "$@" last, so it wins
    cfg = compose_recipe(overrides)
    assert cfg.actor_rollout_ref.model.path == "/models/qwen"
    assert cfg.data.train_files == str(tmp_path / "train.parquet")
    assert cfg.data.val_files == str(tmp_path / "val.parquet")
    assert cfg.trainer.n_gpus_per_node == 4 and cfg.trainer.total_training_steps == 3 and cfg.bpo.fixed.k == 4
    command = dry_run(script, PYTHON="/opt/py/bin/python")
    assert command[:3] == ["/opt/py/bin/python", "-m", "verl_bpo.main"]


# --- data preparation -------------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    assert path.is_file(), path
    return pd.read_parquet(path).to_dict("records")


def check_rows(rows: list[dict], benchmark: str, split: str) -> list[dict]:
    """verl's columns, the tree agent loop, the sandbox spec and the task in extra_info; returns the tasks."""
    assert rows
    tasks = []
    for i, row in enumerate(rows):
        assert row["agent_name"] == "bpo_tree" and row["data_source"] == f"bpo/{benchmark}"
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        extra = row["extra_info"]
        assert extra["split"] == split and extra["index"] == i
        assert json.loads(extra["sandbox"])["name"] == benchmark
        tasks.append(json.loads(extra["task"]))
    return tasks


def sandbox_config(rows: list[dict]) -> dict:
    configs = {row["extra_info"]["sandbox"] for row in rows}
    assert len(configs) == 1
    return json.loads(configs.pop())["config"]


def test_agent_name_matches_the_agent_loop():
    import inspect

    from verl_bpo.integration.agent_loop import AGENT_NAME

    assert inspect.signature(sandbox_rows).parameters["agent_name"].default == AGENT_NAME


def test_placeholder_rows_have_the_rendered_rows_schema():
    tasks = [{"task_id": 0}, {"task_id": 1}]
    rendered = sandbox_rows("smoke", tasks, {"length": 3}, split="val")
    placeholder = sandbox_rows("smoke", tasks, {"length": 3}, split="val", render=False)
    for a, b in zip(rendered, placeholder, strict=True):
        assert a.keys() == b.keys() and a["extra_info"] == b["extra_info"]
        assert {k: v for k, v in a.items() if k != "prompt"} == {k: v for k, v in b.items() if k != "prompt"}
        assert "placeholder" in b["prompt"][0]["content"]


def test_webshop_generated_catalogue_with_the_labelled_fake(tmp_path):
    out = tmp_path / "webshop"
    prepare_data.main(["webshop", "--out", str(out), "--generate", "12", "--engine", "fake",
                       "--train-goals", "4:", "--val-goals", "0:4"])
    train, val = read_rows(out / "train.parquet"), read_rows(out / "val.parquet")
    assert check_rows(train, "webshop", "train") == [{"goal_index": i} for i in range(4, 12)]  # open end: all goals
    assert check_rows(val, "webshop", "val") == [{"goal_index": i} for i in range(4)]
    config = sandbox_config(train)
    assert config == {"engine": "fake", "data_dir": str(out / "source"), "max_steps": 15}
    assert "search[" in train[0]["prompt"][0]["content"] and "Instruction" in train[0]["prompt"][1]["content"]


def test_webshop_without_the_real_engine_never_falls_back_to_the_fake(tmp_path, monkeypatch):
    from sandbox_adapters.webshop.data import generate_catalogue

    monkeypatch.delenv("WEBSHOP_ROOT", raising=False)
    data = tmp_path / "catalogue"
    generate_catalogue(str(data), num=5, seed=0)
    args = ["webshop", "--out", str(tmp_path / "out"), "--data-dir", str(data)]
    with pytest.raises(SystemExit, match="--no-render"):
        prepare_data.main(args)
    with pytest.raises(SystemExit, match="explicit goal ranges"):
        prepare_data.main([*args, "--no-render"])  # the default train range 1500: is open-ended
    prepare_data.main([*args, "--no-render", "--train-goals", "1500:1510", "--val-goals", "0:3",
                       "--webshop-root", "/opt/WebShop", "--sandbox-config", "max_steps=12"])
    train = read_rows(tmp_path / "out" / "train.parquet")
    assert check_rows(train, "webshop", "train") == [{"goal_index": i} for i in range(1500, 1510)]
    assert sandbox_config(train) == {"engine": "web_agent_site", "data_dir": str(data), "webshop_root": "/opt/WebShop",
                                     "max_steps": 12}
    assert "placeholder" in train[0]["prompt"][0]["content"]
    assert not (tmp_path / "out" / "source").exists()


@pytest.fixture(scope="module")
def alfworld_out(tmp_path_factory):
    pytest.importorskip("alfworld")
    out = tmp_path_factory.mktemp("alfworld")
    prepare_data.main(["alfworld", "--out", str(out), "--generate", "2", "--task-types", "pick_and_place_simple",
                       "--max-val", "1"])
    return out


@pytest.mark.slow
def test_alfworld_generated_games(alfworld_out):
    train, val = read_rows(alfworld_out / "train.parquet"), read_rows(alfworld_out / "val.parquet")
    train_tasks, val_tasks = check_rows(train, "alfworld", "train"), check_rows(val, "alfworld", "val")
    assert len(train_tasks) == 2 and len(val_tasks) == 1
    for task in train_tasks + val_tasks:
        assert Path(task["game"]).is_absolute() and Path(task["game"]).is_file()
    assert all("/train/" in t["game"] for t in train_tasks) and "/valid_unseen/" in val_tasks[0]["game"]
    assert sandbox_config(train) == {"max_steps": 50}
    assert "Your task is to" in train[0]["prompt"][1]["content"]


@pytest.mark.slow
def test_alfworld_data_dir_and_env_var_without_rendering(alfworld_out, tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_out / "source"))
    prepare_data.main(["alfworld", "--out", str(tmp_path), "--no-render", "--val-split", "train"])
    train, val = read_rows(tmp_path / "train.parquet"), read_rows(tmp_path / "val.parquet")
    rendered = [json.loads(r["extra_info"]["task"]) for r in read_rows(alfworld_out / "train.parquet")]
    assert check_rows(train, "alfworld", "train") == rendered == check_rows(val, "alfworld", "val")
    assert "placeholder" in train[0]["prompt"][0]["content"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the SWE sandbox confines commands with bubblewrap")
def test_swebench_generated_tasks_and_instance_files(tmp_path):
    pytest.importorskip("swebench")
    out = tmp_path / "swe"
    prepare_data.main(["swebench", "--out", str(out), "--generate", "3"])
    train, val = read_rows(out / "train.parquet"), read_rows(out / "val.parquet")
    train_tasks, val_tasks = check_rows(train, "swebench", "train"), check_rows(val, "swebench", "val")
    assert len(train_tasks) == 3 and len(val_tasks) == 1
    for task in train_tasks + val_tasks:
        assert Path(task["repo_path"], ".git").is_dir() and {"base_commit", "eval_script"} <= task.keys()
    assert sandbox_config(train) == {"max_steps": 30, "max_output_chars": 4000}
    assert "Issue:" in train[0]["prompt"][1]["content"]
    # The path a user takes with real data: instance files (SWE-bench's own loader) next to repos/ checkouts.
    again = tmp_path / "again"
    prepare_data.main(["swebench", "--out", str(again), "--no-render",
                       "--train-instances", str(out / "source" / "train" / "instances.jsonl"),
                       "--val-instances", str(out / "source" / "val" / "instances.jsonl")])
    assert check_rows(read_rows(again / "train.parquet"), "swebench", "train") == train_tasks
    assert check_rows(read_rows(again / "val.parquet"), "swebench", "val") == val_tasks
    with pytest.raises(SystemExit, match="--val-instances"):
        prepare_data.main(["swebench", "--out", str(tmp_path / "x"),
                           "--train-instances", str(out / "source" / "train" / "instances.jsonl")])


def test_prepare_data_runs_as_a_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "verl_bpo.data.prepare", "webshop", "--out", str(tmp_path), "--generate", "6",
         "--engine", "fake", "--train-goals", "2:6", "--val-goals", "0:2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "4 train rows" in out.stdout and "2 val rows" in out.stdout and "not WebShop" in out.stdout
    assert len(read_rows(tmp_path / "train.parquet")) == 4


def test_the_cpu_demo_runs_compose_and_differ_only_in_the_estimator(tmp_path):
    from sandbox_adapters.registry import make_sandbox

    demo = cpu_demo
    settings = demo.DemoSettings()
    tasks = demo.TASK.tasks(range(4))
    for split in ("train", "val"):  # the checks before Ray read the datasets
        write_sandbox_dataset(tmp_path / f"{split}.parquet", sandbox_rows(
            demo.TASK.sandbox, tasks, demo.TASK.sandbox_config, split=split))
    # BPO's training rows: GRPO's, each with its task's budget from GRPO's tree log
    write_sandbox_dataset(tmp_path / "train_bpo.parquet", demo.matched_rows(grpo_tree_log(tasks), tasks))
    train = {"bpo": tmp_path / "train_bpo.parquet", "grpo": tmp_path / "train.parquet"}

    def compose_run(estimator):
        return compose_recipe(demo.run_overrides(estimator, tmp_path / "model", train[estimator],
                                                 tmp_path / "val.parquet", tmp_path / "out", 12, settings))

    configs = {e: flat(compose_run(e)) for e in ("bpo", "grpo")}
    differ = {k for k in configs["bpo"].keys() | configs["grpo"].keys()
              if configs["bpo"].get(k) != configs["grpo"].get(k)}
    assert differ == {"algorithm.adv_estimator", "data.train_files"}
    bpo_rows, grpo_rows = (pd.read_parquet(train[e]).to_dict("records") for e in ("bpo", "grpo"))
    for b, g in zip(bpo_rows, grpo_rows, strict=True):  # the same rows in the same order, plus the budgets
        assert b["extra_info"].pop("bpo_budget") > 0
        assert json.dumps(b, sort_keys=True, default=str) == json.dumps(g, sort_keys=True, default=str)
    cfg = compose_run("bpo")
    bpo = prepare_config(cfg)
    assert cfg.actor_rollout_ref.rollout.n == settings.rollout_n and cfg.data.train_batch_size == settings.batch_size
    assert bpo.allocation == "learned" and bpo.learned.budget_unit == "tokens" and bpo.tree_log.endswith("trees.jsonl")
    assert bpo.sandbox.name == demo.TASK.sandbox and dict(bpo.sandbox.config) == dict(demo.TASK.sandbox_config)
    assert cfg.trainer.test_freq > 0 and cfg.data.val_files.endswith("val.parquet")  # held-out evaluation
    # Both runs train with the demo's AdamW eps, 1e-4: at 1e-5 the warm start's turn format broke mid-run in 7 of 15
    # runs (turns that run on to max_tokens_per_turn), at 1e-4 in none of 15 (docs/results.md).
    assert cfg.actor_rollout_ref.actor.optim.override_optimizer_config.eps == settings.adam_eps == 1e-4
    make_sandbox(bpo.sandbox.name, dict(bpo.sandbox.config)).close()  # the sandbox accepts the demo's settings
    # verl stops after one pass over the task set on CPU: the default steps must fit in it
    assert 24 * settings.batch_size <= len(demo.TASK.train_ids)


def grpo_tree_log(tasks, tokens=lambda i: 90.0 + i, per_step=2) -> list[str]:
    """``bpo.tree_log`` lines of a GRPO run (as ``append_tree`` writes them) that trained on each task once."""
    lines = []
    for step, start in enumerate(range(0, len(tasks), per_step), 1):
        trees = [{"uid": f"u{i}", "task": dict(tasks[i]), "generated_tokens": tokens(i), "env_steps": 8.0 * (i + 1)}
                 for i in range(start, min(start + per_step, len(tasks)))]
        lines.append(json.dumps({"step": step, "uid": trees[0]["uid"], "leaves": [], "metrics": {}, "trees": trees}))
    return lines


def test_the_demo_budgets_each_bpo_tree_with_grpos_group_on_its_task():
    demo = cpu_demo
    tasks = demo.TASK.tasks(range(5))
    log = grpo_tree_log(list(reversed(tasks)))  # GRPO's order is its dataloader's, not the rows'
    assert demo.matched_budgets(log, tasks) == [94.0, 93.0, 92.0, 91.0, 90.0]
    rows = demo.matched_rows(log, tasks)
    assert [json.loads(r["extra_info"]["task"]) for r in rows] == tasks
    assert [r["extra_info"]["bpo_budget"] for r in rows] == [94.0, 93.0, 92.0, 91.0, 90.0]
    assert rows[0]["prompt"] == sandbox_rows(demo.TASK.sandbox, tasks[:1], demo.TASK.sandbox_config)[0]["prompt"]
    with pytest.raises(ValueError, match=r"no group for 1 of the 6 training tasks \(first: \{\"task_id\": 5\}\)"):
        demo.matched_budgets(log, demo.TASK.tasks(range(6)))
    with pytest.raises(ValueError, match=r"task \{\"task_id\": 0\} was trained on at steps 1 and 3"):
        demo.matched_budgets(grpo_tree_log(tasks + tasks[:1]), tasks)
    with pytest.raises(ValueError, match=r"generated no tokens"):
        demo.matched_budgets(grpo_tree_log(tasks, tokens=lambda i: 0.0), tasks)
    with pytest.raises(ValueError, match=r"no 'trees' list"):
        demo.matched_budgets([json.dumps({"step": 1, "uid": "u", "leaves": [], "metrics": {}})], tasks)


def test_the_demo_reports_bpo_spend_against_grpo_on_the_same_tasks():
    tasks = cpu_demo.TASK.tasks(range(4))
    grpo = grpo_tree_log(tasks, tokens=lambda i: 100.0)
    bpo = [json.dumps({**json.loads(line), "trees": [{**t, "generated_tokens": 150.0, "budget": 100.0}
                                                    for t in json.loads(line)["trees"]]}) for line in grpo]
    bpo[-1] = bpo[-1].replace('"step": 2', '"step": 3')
    spend = cpu_demo.spend_comparison(grpo, bpo)
    assert spend == {"tasks": 4.0, "same_update_share": 0.5, "bpo_over_grpo_generated_tokens": 1.5,
                     "bpo_spent_over_budget": 1.5}
    assert "generated tokens per task and update" in cpu_demo.MATCHED_COMPUTE
    assert cpu_demo.MATCHED_COMPUTE.replace("\n", " ") in " ".join(cpu_demo.__doc__.split())


def test_the_demo_reruns_bpo_alone_on_an_earlier_demos_grpo_run(tmp_path, monkeypatch):
    """``--grpo-from DIR``: BPO trains on the budgets of the GRPO run in DIR, GRPO does not train again, and the
    table takes GRPO's row from DIR; ``--bpo-allocation fixed`` trains the fixed rule on the rows without budgets."""
    demo = cpu_demo
    earlier, steps = tmp_path / "earlier", 2
    tasks = demo.TASK.tasks(demo.TASK.train_ids[: steps * demo.DemoSettings.batch_size])

    def write_run(folder, tokens):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / demo.TREE_LOG).write_text("\n".join(grpo_tree_log(tasks, tokens=lambda i: tokens, per_step=4)))
        metrics = {"bpo/success_rate": 0.5, "bpo/generated_tokens": tokens, "bpo/turn_tokens": tokens / 40.0,
                   "bpo/trainer_rows": 8.0, "global_seqlen/mean": 4000.0}
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "data": metrics})
                                                        for s in range(1, steps + 1)))
        return demo.cpu_launch.RunResult(0, False, 5.0, 0.0, 0, "", demo.cpu_launch.read_metrics(
            folder / "metrics.jsonl"))

    write_run(earlier / "grpo", 100.0)
    (earlier / "summary.json").write_text(json.dumps({"summary": {"grpo": {"wall_s": 123.0}}}))
    trained = []

    def fake_train(estimator, model, train_data, val_data, out, steps, settings, timeout_s=1800):
        trained.append((estimator, model, pd.read_parquet(train_data).to_dict("records"), dict(settings.bpo)))
        return write_run(out, 160.0)  # BPO's turns ran on: 4 tokens a turn

    monkeypatch.setattr(demo, "task_model", lambda out, task: out / "tiny_warm_late")
    monkeypatch.setattr(demo, "train", fake_train)
    monkeypatch.setattr(demo, "plot_learning", lambda data, path, bpo_setting: None)
    monkeypatch.setattr(demo, "draw_logged_tree", lambda log, path: None)
    out = tmp_path / "rerun"
    demo.main(["--steps", str(steps), "--out", str(out), "--grpo-from", str(earlier)])
    (estimator, model, rows, bpo), = trained
    assert estimator == "bpo" and model == earlier / "tiny_warm_late" and bpo["allocation"] == "learned"
    assert [r["extra_info"]["bpo_budget"] for r in rows] == [100.0] * len(tasks)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summary"]["grpo"]["wall_s"] == 123.0 and summary["bpo_over_grpo_generated_tokens"] == 1.6
    assert summary["curves"]["bpo"]["turn_tokens"] == [4.0, 4.0]
    assert summary["summary"]["bpo"]["peak_turn_tokens"] == 4.0
    assert summary["grpo_from"] == str(earlier / "grpo") and not (out / "grpo").exists()

    trained.clear()
    demo.main(["--steps", str(steps), "--out", str(out), "--grpo-from", str(earlier), "--bpo-allocation", "fixed"])
    (_, _, rows, bpo), = trained
    assert bpo == {"allocation": "fixed"} and all("bpo_budget" not in r["extra_info"] for r in rows)
    assert json.loads((out / "summary.json").read_text())["matched"].startswith("leaves")
    with pytest.raises(ValueError, match="--grpo-from: .* holds no finished GRPO run"):
        demo.main(["--steps", str(steps), "--out", str(out), "--grpo-from", str(tmp_path / "none")])
    # a GRPO run on another task or optimizer (as hydra recorded its command line) gives no budgets for this demo
    recorded = earlier / "grpo" / "hydra" / ".hydra" / "overrides.yaml"
    recorded.parent.mkdir(parents=True)
    ours = demo.run_overrides("grpo", model, tmp_path, tmp_path, out, 24, demo.DemoSettings())
    recorded.write_text("".join(f"- {o}\n" for o in ours))
    assert demo.earlier_run(earlier / "grpo", demo.DemoSettings()).metrics  # the same settings: accepted
    for changed in ("+bpo.sandbox.config.invalid_penalty=0.5", "actor_rollout_ref.actor.optim.lr=0.001",
                    "++actor_rollout_ref.actor.optim.override_optimizer_config={eps:1e-08}"):
        key = changed.split("=")[0]
        recorded.write_text("".join(f"- {o}\n" for o in ours if not o.startswith(key + "=")) + f"- {changed}\n")
        with pytest.raises(ValueError, match=r"other settings \(\[.*" + re.escape(changed)):
            demo.main(["--steps", str(steps), "--out", str(out), "--grpo-from", str(earlier)])
    recorded.write_text("".join(f"- {o}\n" for o in ours))
    with pytest.raises(ValueError, match=r"other settings \(\[.*eps:1e-05"):  # this demo's eps is not that run's
        demo.main(["--steps", str(steps), "--out", str(out), "--grpo-from", str(earlier), "--adam-eps", "1e-5"])
    with pytest.raises(SystemExit):
        demo.main(["--steps", str(steps), "--out", str(out), "--adam-eps", "0"])


def _benchmark(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("name", ["packed_update", "rollout_cost", "cpu_step"])
def test_each_benchmarks_trainer_overrides_compose_and_pass_the_checks_before_ray(name, tmp_path):
    """A benchmark's verl run is built from the same settings users pass: a renamed or removed ``bpo.*`` key must
    fail here, not after the benchmark has built its model."""
    task = cpu_demo.TASK
    data = write_sandbox_dataset(tmp_path / "train.parquet", sandbox_rows(
        task.sandbox, task.tasks(range(8)), task.sandbox_config))
    bench, model, out = _benchmark(name), tmp_path / "model", tmp_path / "out"
    if name == "packed_update":
        setup = bench.demo_setup(tmp_path, steps=2)
        runs = [bench.overrides(model, setup, label, out / label, 2) for label in bench.RUNS]
    elif name == "rollout_cost":
        runs = [bench.overrides(model, data, task.sandbox, estimator, out, 4, "quantile")
                for estimator in ("bpo", "grpo")]
    else:
        runs = [bench.overrides(model, data, out, 2, tmp_path / "batches", [])]
    for overrides in runs:
        cfg = compose_recipe(overrides)
        bpo = prepare_config(cfg)
        assert bpo.sandbox.name == task.sandbox and cfg.algorithm.adv_estimator in ("bpo", "grpo")

