"""What the trainer pays for a BPO step with packed trees (``bpo.packed``) against the leaf layout and GRPO, in
verl's real CPU trainer, side by side in one run.

    python benchmarks/packed_update.py [--out runs/packed_update] [--steps 5] [--tasks demo,textworld] [--from-logs]

For each task, three training runs through ``python -m verl_bpo.main`` with the same model, tasks and settings:

* ``bpo_packed``: ``adv_estimator=bpo``, ``bpo.packed=true`` (each tree one row of its unique tokens);
* ``bpo_leaf``: the same with ``bpo.packed=false`` (one row per leaf, shared prefixes once per leaf below them);
* ``grpo``: ``adv_estimator=grpo``, N = 8 independent rollouts through the same agent loop.

BPO runs the learned allocation under the token budget (each tree may generate what GRPO's group of 8 generates
on that task), as the CPU demo does: the trees are the ones the allocator grows, not a fixed shape. Tasks:

* ``demo``: the CPU demo's task and model (the signpost corridor, ``verl_bpo.demo.tasks``, up to 8 turns);
* ``textworld``: TextWorld games made by ``tw-make``, 10 turns of the demo's tiny model with the games'
  observations (the untrained model rarely finishes, so most episodes run all 10 turns).

Measured on the steps after the allocator's warm-up (``--skip``, default 2: the first 8 trees are exploration
trees): trained tokens per task (what the actor forwards and back-propagates: verl's ``global_seqlen`` over the
tasks of a step; for the packed run also the leaf layout of the same trees, ``bpo/trained_tokens_leaf_layout``);
verl's ``timing_s/old_log_prob``, ``timing_s/update_actor`` and ``timing_s/step`` (rollout + training) per update;
generated tokens per tree (what the budget matches); the machine's memory in use at each step
(verl's ``perf/cpu_memory_used_gb`` as the actor reports it: the whole machine's, vLLM's CPU cache and Ray
included, a coarse reading).

Last line, one JSON object: ``trained_tokens_packed_over_leaf``, ``trained_tokens_packed_over_grpo``,
``update_s_packed_over_grpo``, ``logprob_s_packed_over_grpo``, ``update_s_packed_over_leaf``,
``logprob_s_packed_over_leaf``, ``step_s_bpo_over_grpo``, ``gen_tokens_bpo_over_grpo`` (means over tasks) and
``by_task``. Targets: trained tokens <= 0.5x the leaf layout and <= 0.9x GRPO's; ``update_actor`` and
``old_log_prob`` <= 1.0x GRPO's; the whole step <= 1.0x GRPO's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.demo.tasks import TASKS, task_model
from verl_bpo.platforms import cpu_launch

ROLLOUT_N, TASKS_PER_STEP = 8, 4
LEARNED = {"budget_unit": "tokens", "max_leaves": 16, "warmup_trees": 8, "explore_share": 0.1}  # bpo.learned.*
RUNS = {"bpo_packed": ("bpo", ["bpo.packed=true"]), "bpo_leaf": ("bpo", ["bpo.packed=false"]), "grpo": ("grpo", [])}
TIMINGS = {"logprob_s": "timing_s/old_log_prob", "update_s": "timing_s/update_actor", "step_s": "timing_s/step"}


def demo_setup(root: Path, steps: int) -> dict:
    task = TASKS["late"]
    ids = task.train_ids[: steps * TASKS_PER_STEP]
    data = write_sandbox_dataset(root / "data_demo" / "train.parquet",
                                 sandbox_rows(task.sandbox, task.tasks(ids), task.sandbox_config))
    return {"sandbox": task.sandbox, "config": dict(task.sandbox_config), "data": data, "max_turns": task.max_turns,
            "max_tokens_per_turn": 6, "prompt": 192, "response": 320, "lr": task.lr}


def textworld_setup(root: Path, steps: int) -> dict:
    from sandbox_adapters.textworld import make_games

    games = make_games(root / "textworld_games", range(steps * TASKS_PER_STEP))
    config = {"max_steps": 10}
    data = write_sandbox_dataset(root / "data_textworld" / "train.parquet",
                                 sandbox_rows("textworld", [{"game": str(g)} for g in games], config))
    return {"sandbox": "textworld", "config": config, "data": data, "max_turns": 10, "max_tokens_per_turn": 8,
            "prompt": 1024, "response": 2048, "lr": 1e-4}


SETUPS = {"demo": demo_setup, "textworld": textworld_setup}


def overrides(model: Path, setup: dict, label: str, out: Path, steps: int) -> list[str]:
    """The trainer overrides of run ``label`` (tests compose and validate them, so a renamed setting fails there)."""
    estimator, extra = RUNS[label]
    bpo = {"max_turns": setup["max_turns"], "max_tokens_per_turn": setup["max_tokens_per_turn"], "allocation": "learned"}
    return cpu_launch.cpu_overrides(
        model, setup["data"], setup["data"], output_dir=out, n=ROLLOUT_N, batch_size=TASKS_PER_STEP, steps=steps,
        adv_estimator=estimator, max_prompt_length=setup["prompt"], max_response_length=setup["response"],
        lr=setup["lr"],
        extra=[*(f"bpo.{k}={v}" for k, v in bpo.items()), *(f"bpo.learned.{k}={v}" for k, v in LEARNED.items()),
               f"bpo.sandbox.name={setup['sandbox']}",
               *(f"+bpo.sandbox.config.{k}={v}" for k, v in setup["config"].items()), *extra])


def run(model: Path, setup: dict, label: str, out: Path, steps: int, from_logs: bool) -> dict[int, dict[str, float]]:
    log, metrics_path = out / "console.log", out / "metrics.jsonl"
    if from_logs:  # summarise a finished run again (e.g. with a changed summary), without training
        return cpu_launch.read_metrics(metrics_path)
    result = cpu_launch.run_trainer(overrides(model, setup, label, out, steps), log_path=log,
                                    metrics_path=metrics_path, module="verl_bpo.main",
                                    timeout_s=2400, cwd=out.parent)
    if result.returncode != 0:
        tail = "\n".join(result.log.splitlines()[-30:])
        raise RuntimeError(f"{label} failed (exit {result.returncode}); log {log}\n{tail}")
    return result.metrics


def summarise(metrics: dict[int, dict[str, float]], skip: int) -> dict[str, float]:
    steps = [m for step, m in sorted(metrics.items()) if step > skip]
    mean = lambda key: statistics.mean(m[key] for m in steps) if all(key in m for m in steps) else None  # noqa: E731
    row = {name: mean(key) for name, key in TIMINGS.items()}
    row["trained_tokens_per_task"] = mean("global_seqlen/mean") / TASKS_PER_STEP  # one data-parallel rank
    row["gen_tokens_per_task"] = mean("bpo/generated_tokens")
    row["memory_gb_max"] = max(m.get("actor/perf/cpu_memory_used_gb", 0.0) for m in steps)
    row["steps_measured"] = len(steps)
    if mean("bpo/trained_tokens_leaf_layout") is not None:
        row["trained_tokens_packed_over_leaf_same_trees"] = (
            mean("bpo/trained_tokens") / mean("bpo/trained_tokens_leaf_layout"))
    return row


def ratios(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    packed, leaf, grpo = rows["bpo_packed"], rows["bpo_leaf"], rows["grpo"]
    return {
        "trained_tokens_packed_over_leaf": packed["trained_tokens_packed_over_leaf_same_trees"],
        "trained_tokens_packed_over_leaf_runs": packed["trained_tokens_per_task"] / leaf["trained_tokens_per_task"],
        "trained_tokens_packed_over_grpo": packed["trained_tokens_per_task"] / grpo["trained_tokens_per_task"],
        "update_s_packed_over_grpo": packed["update_s"] / grpo["update_s"],
        "logprob_s_packed_over_grpo": packed["logprob_s"] / grpo["logprob_s"],
        "update_s_packed_over_leaf": packed["update_s"] / leaf["update_s"],
        "logprob_s_packed_over_leaf": packed["logprob_s"] / leaf["logprob_s"],
        "step_s_bpo_over_grpo": packed["step_s"] / grpo["step_s"],
        "gen_tokens_bpo_over_grpo": packed["gen_tokens_per_task"] / grpo["gen_tokens_per_task"],
        "memory_gb_packed_leaf_grpo": [packed["memory_gb_max"], leaf["memory_gb_max"], grpo["memory_gb_max"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/packed_update"))
    parser.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the means (default 2)")
    parser.add_argument("--tasks", default="demo,textworld")
    parser.add_argument("--from-logs", action="store_true", help="summarise the runs already in --out again")
    args = parser.parse_args()
    root = args.out.resolve()
    model = task_model(root, TASKS["late"])  # the demo's warm-started tiny model
    by_task = {}
    for name in args.tasks.split(","):
        setup = SETUPS[name](root, args.steps)
        rows = {}
        for label in RUNS:
            print(f"{name}: {label} ({args.steps} steps) ...", flush=True)
            metrics = run(model, setup, label, root / name / label, args.steps, args.from_logs)
            rows[label] = summarise(metrics, args.skip)
        by_task[name] = {"ratios": ratios(rows), "runs": rows}
        print(f"\n{name}: per task and update (steps {args.skip + 1}-{args.steps})")
        print(f"{'run':12s} {'trained tok':>12s} {'gen tok':>9s} {'old_log_prob s':>15s} {'update_actor s':>15s} "
              f"{'step s':>8s} {'memory GB':>10s}")
        for label, row in rows.items():
            print(f"{label:12s} {row['trained_tokens_per_task']:12.0f} {row['gen_tokens_per_task'] or 0:9.0f} "
                  f"{row['logprob_s']:15.3f} {row['update_s']:15.3f} {row['step_s']:8.2f} {row['memory_gb_max']:10.2f}")
        print(json.dumps(by_task[name]["ratios"]), flush=True)
    keys = [k for k in next(iter(by_task.values()))["ratios"] if k != "memory_gb_packed_leaf_grpo"]
    out = {k: statistics.mean(t["ratios"][k] for t in by_task.values()) for k in keys}
    out["by_task"] = {name: t["ratios"] for name, t in by_task.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
