"""Train/val parquet files of a benchmark recipe: ``python -m verl_bpo.data.prepare BENCHMARK --out DIR``.

One row per task in verl's dataset format (``verl_bpo.data``): ``agent_name: bpo_tree``, the sandbox spec and the
task in ``extra_info``, and the prompt as the sandbox renders it (system prompt + first observation), so verl's
``data.filter_overlong_prompts`` sees the real prompt. The recipes in ``recipes/<benchmark>/`` read
``DIR/train.parquet`` and ``DIR/val.parquet``.

How each benchmark's tasks are enumerated (the ``BENCHMARKS`` table):

``webshop``
    ``{"goal_index": i}`` for the goal ranges ``--train-goals`` / ``--val-goals`` (``START:END``; an open ``END``
    is counted from the engine). Defaults follow WebShop's own split of its goal list: 0-499 test (our val),
    1500-end train (500-1499 is WebShop's dev split). Point ``--data-dir`` (or ``$WEBSHOP_DATA``) at the engine's
    data folder and ``--webshop-root`` (or ``$WEBSHOP_ROOT``) at a princeton-nlp/WebShop checkout.
``alfworld``
    ``{"game": <absolute path of a game.tw-pddl>}`` for every solvable game of ``--train-split`` (default
    ``train``) and ``--val-split`` (default ``valid_unseen``) under ``--data-dir`` (or ``$ALFWORLD_DATA``, laid out
    as ``alfworld-download`` leaves it).
``swebench``
    SWE-bench-schema instances from local ``.json``/``.jsonl``/``.parquet`` files (``--train-instances``,
    ``--val-instances``): rows of the SWE-bench 5 schema, or classic rows (SWE-bench Verified as published, 13
    fields) whose ``eval_script``, ``log_parser``, ``eval_type`` and ``image`` are derived from their repo and
    version (``sandbox_adapters.swebench.verified``); a row that lacks a needed field is refused, naming it. With
    ``--backend docker`` (the way to run SWE-bench Verified) each instance runs in its image: the dataset's
    ``image`` field, else the name the SWE-bench harness derives from the instance id
    (``swebench/sweb.eval.x86_64.<id with __ as _1776_>:latest``, namespace ``--image-namespace``); the images must
    be on the training nodes' Docker engine (``docker load``/build them; nothing is pulled). With the default
    ``--backend local`` each instance needs a git checkout at ``<repos dir>/<instance_id>``
    (``--train-repos-dir``/``--val-repos-dir``, default ``repos/`` next to the file). SWE-bench Verified has only a
    test split: train on a SWE-bench-schema training set and validate on Verified.

Smoke-size data (``--generate N``) comes from this project's own generators (a synthetic WebShop catalogue, ALFRED-
format problems turned into ALFWorld games by the real ``alfworld-generate``, small buggy Python repositories):
it checks the pipeline and is not the benchmark.

Rendering needs the sandbox's engine at hand and costs one reset per task (seconds per game on full ALFWorld, one
checkout per SWE instance). ``--no-render`` writes the same rows with a placeholder prompt instead: the ``bpo_tree``
agent loop renders the real prompt from a fresh reset anyway, but ``data.filter_overlong_prompts`` then filters
nothing, so keep ``data.max_prompt_length`` generous. WebShop's real engine is never replaced by the labelled fake
unless ``--engine fake`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_bpo.data.rows import sandbox_rows, write_sandbox_dataset

__all__ = ["BENCHMARKS", "Plan", "build_plan", "prepare", "main"]

SPLITS = ("train", "val")


@dataclasses.dataclass
class Plan:
    """What one benchmark contributes: the sandbox config every row carries and the tasks of each split."""

    sandbox: str
    sandbox_config: dict[str, Any]
    tasks: dict[str, list[dict[str, Any]]]
    notes: list[str] = dataclasses.field(default_factory=list)


# --- webshop ---------------------------------------------------------------------------------------------------
def _webshop_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="engine data folder (default $WEBSHOP_DATA; with --generate: OUT/source)")
    parser.add_argument("--webshop-root", help="princeton-nlp/WebShop checkout (default $WEBSHOP_ROOT)")
    parser.add_argument("--engine", choices=("web_agent_site", "fake"), default="web_agent_site",
                        help="'fake' is the labelled stand-in for tests and demos, not WebShop")
    parser.add_argument("--train-goals", default="1500:", help="goal index range START:END (default 1500:)")
    parser.add_argument("--val-goals", default="0:500", help="goal index range START:END (default 0:500)")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="write a synthetic catalogue of N products into OUT/source first (smoke data)")


def _goal_range(spec: str, count: Callable[[], int], flag: str) -> range:
    start, sep, end = spec.partition(":")
    if not sep or not start.strip():
        raise ValueError(f"{flag}={spec!r}: use START:END (END may be left empty to mean all goals)")
    return range(int(start), int(end) if end.strip() else count())


def _webshop_plan(args: argparse.Namespace) -> Plan:
    notes = []
    data_dir = args.data_dir
    if args.generate:
        from sandbox_adapters.webshop.data import generate_catalogue

        data_dir = data_dir or os.path.join(args.out, "source")
        generate_catalogue(data_dir, num=args.generate, seed=args.seed)
        notes.append(f"generated a synthetic catalogue of {args.generate} products in {data_dir} (smoke data)")
    data_dir = data_dir or os.environ.get("WEBSHOP_DATA")
    if not data_dir:
        raise ValueError("webshop: give --data-dir or set $WEBSHOP_DATA (the engine's data folder)")
    config: dict[str, Any] = {"engine": args.engine, "data_dir": os.path.abspath(data_dir)}
    root = args.webshop_root or os.environ.get("WEBSHOP_ROOT")
    if args.engine == "web_agent_site":
        if root:
            config["webshop_root"] = os.path.abspath(root)
        else:
            notes.append("no --webshop-root/$WEBSHOP_ROOT: the training processes must have $WEBSHOP_ROOT set")
    else:
        notes.append("engine=fake: the labelled stand-in engine, not WebShop; its rewards are not WebShop's")
    needs_engine = not args.no_render or args.engine == "fake"

    def engine() -> Any:
        from sandbox_adapters.registry import make_sandbox
        from sandbox_adapters.webshop import WebShopUnavailable

        try:
            return make_sandbox("webshop", {**config, **args.sandbox_config})
        except WebShopUnavailable as exc:
            raise ValueError(f"{exc}. Without the engine: --no-render with explicit goal ranges START:END writes "
                             "the rows (the training nodes still need the engine); --engine fake uses the "
                             "labelled stand-in") from exc

    if needs_engine:
        engine().close()  # fail here, with the way out, rather than in the middle of rendering

    def count() -> int:
        with engine() as box:
            return len(box._env.server.goals)  # the engine's goal list; the adapter exposes no public count

    tasks = {split: [{"goal_index": i} for i in _goal_range(getattr(args, f"{split}_goals"), count,
                                                           f"--{split}-goals")] for split in SPLITS}
    return Plan("webshop", config, tasks, notes)


# --- alfworld --------------------------------------------------------------------------------------------------
def _alfworld_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="ALFWorld data root (default $ALFWORLD_DATA; with --generate: OUT/source)")
    parser.add_argument("--train-split", default="train")
    parser.add_argument("--val-split", default="valid_unseen")
    parser.add_argument("--task-types", nargs="+", help="ALFWorld task types to keep (default: all six)")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="generate games for seeds 0..N-1 (train) and one seed (val) per task type (smoke data)")


def _alfworld_plan(args: argparse.Namespace) -> Plan:
    from sandbox_adapters.alfworld import resolve_games_dir
    from sandbox_adapters.alfworld.gen import TASK_TYPES, find_games, generate_games, write_problems

    task_types = tuple(args.task_types or TASK_TYPES)
    notes = []
    data_dir = args.data_dir
    if args.generate:
        data_dir = data_dir or os.path.join(args.out, "source")
        seed = args.seed * 10_000
        write_problems(data_dir, range(seed, seed + args.generate), task_types, split=args.train_split)
        write_problems(data_dir, [seed + args.generate], task_types, split=args.val_split)
        generate_games(os.path.join(data_dir, "json_2.1.1"))
        notes.append(f"generated ALFWorld games in {data_dir} (smoke data, not ALFWorld's scenes)")
    if data_dir is None and not os.environ.get("ALFWORLD_DATA"):
        raise ValueError("alfworld: give --data-dir or set $ALFWORLD_DATA")
    tasks = {}
    for split in SPLITS:
        games = find_games(resolve_games_dir(data_dir, getattr(args, f"{split}_split")), task_types)
        if not games:
            raise ValueError(f"alfworld: no solvable games of {list(task_types)} in the {split} split")
        tasks[split] = [{"game": str(game.resolve())} for game in games]
    # tasks name their game by absolute path, so the rows need no data_dir
    return Plan("alfworld", {}, tasks, notes)


# --- swebench --------------------------------------------------------------------------------------------------
def _swebench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-instances", help="SWE-bench-schema .json/.jsonl of training instances")
    parser.add_argument("--train-repos-dir", help="checkouts <dir>/<instance_id> (default: repos/ next to the file)")
    parser.add_argument("--val-instances", help="SWE-bench-schema .json/.jsonl, e.g. SWE-bench Verified exported")
    parser.add_argument("--val-repos-dir", help="checkouts <dir>/<instance_id> (default: repos/ next to the file)")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="generate N train and max(1, N // 3) val tasks into OUT/source (smoke data; with "
                             "--backend docker their images are built on --base-image)")
    parser.add_argument("--backend", choices=("local", "docker"), default="local",
                        help="docker: every instance runs in its image (SWE-bench Verified); local: checkouts")
    parser.add_argument("--image-namespace", default="swebench",
                        help="namespace of derived image names (default swebench, as the SWE-bench harness)")
    parser.add_argument("--base-image", default="bpo/swe-base:bookworm",
                        help="base of the images built for --generate --backend docker (scripts/setup.sh makes it)")


def _swebench_plan(args: argparse.Namespace) -> Plan:
    from sandbox_adapters.swebench.tasks import generate_tasks, load_tasks
    from sandbox_adapters.swebench.verified import complete_instances

    docker = args.backend == "docker"
    notes, tasks = [], {}
    for split in SPLITS:
        path = getattr(args, f"{split}_instances")
        if path and docker:
            from sandbox_adapters.swebench.docker import instance_image_name
            from swebench.harness.utils import load_swebench_dataset

            tasks[split] = [{**inst, "image": instance_image_name(inst, args.image_namespace)}
                            for inst in load_swebench_dataset(os.path.abspath(path))]
        elif path:
            tasks[split] = load_tasks(path, getattr(args, f"{split}_repos_dir"))
        elif args.generate:
            num = args.generate if split == "train" else max(1, args.generate // 3)
            out = os.path.join(args.out, "source", split)
            # different seeds: the generated val tasks are other instances of the same bug kinds
            tasks[split] = [{**inst, "repo_path": os.path.join(out, "repos", inst["instance_id"])}
                            for inst in generate_tasks(out, num=num, seed=args.seed + SPLITS.index(split) * 1000)]
            notes.append(f"generated {num} {split} tasks in {out} (smoke data, not SWE-bench)")
            if docker:
                from sandbox_adapters.swebench.docker import build_instance_image, instance_image_name

                for task in tasks[split]:
                    image = instance_image_name({"instance_id": task["instance_id"]}, args.image_namespace)
                    task["image"] = build_instance_image(image, task.pop("repo_path"), args.base_image)
                notes.append(f"built the {split} tasks' images on {args.base_image}")
        else:
            raise ValueError(f"swebench: give --{split}-instances FILE (or --generate N for smoke data)")
        if path:
            # classic rows (SWE-bench Verified as published) get the fields the grader needs, or are refused here
            tasks[split] = complete_instances(tasks[split], setup=docker)
        if not docker:
            tasks[split] = [{**t, "repo_path": os.path.abspath(t["repo_path"])} for t in tasks[split]]
    if docker:
        images = sorted({t["image"] for split in SPLITS for t in tasks[split]})
        notes.append(f"{len(images)} instance image(s), e.g. {images[0]}: they must be on every training node's "
                     "Docker engine (nothing is pulled)")
        return Plan("swebench", {"backend": "docker"}, tasks, notes)
    return Plan("swebench", {}, tasks, notes)


# name -> (add the benchmark's arguments, build its plan, default sandbox config).
# The defaults match the recipes: the sandbox's own episode limit equals the recipe's bpo.max_turns, and SWE
# command output is cut shorter than the adapter's default so that 30 turns fit the recipe's response length.
BENCHMARKS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Plan],
                            dict[str, Any]]] = {
    "webshop": (_webshop_args, _webshop_plan, {"max_steps": 15}),
    "alfworld": (_alfworld_args, _alfworld_plan, {"max_steps": 50}),
    "swebench": (_swebench_args, _swebench_plan, {"max_steps": 30, "max_output_chars": 4000}),
}


def _limit(tasks: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    return tasks if limit is None else tasks[:limit]


def build_plan(args: argparse.Namespace) -> Plan:
    _, plan_fn, defaults = BENCHMARKS[args.benchmark]
    plan = plan_fn(args)
    plan.sandbox_config = {**defaults, **plan.sandbox_config, **args.sandbox_config}
    plan.tasks = {"train": _limit(plan.tasks["train"], args.max_train), "val": _limit(plan.tasks["val"], args.max_val)}
    return plan


def prepare(args: argparse.Namespace) -> dict[str, Path]:
    """Build the plan and write ``OUT/{train,val}.parquet``; returns the written paths."""
    plan = build_plan(args)
    out = {}
    for split in SPLITS:
        tasks = plan.tasks[split]
        if not tasks:
            raise ValueError(f"{args.benchmark}: the {split} split has no tasks")
        if args.no_render:
            rows = sandbox_rows(plan.sandbox, tasks, plan.sandbox_config, split=split, render=False)
        else:
            rows = sandbox_rows(plan.sandbox, tasks, plan.sandbox_config, split=split)
        out[split] = write_sandbox_dataset(Path(args.out) / f"{split}.parquet", rows)
        print(f"{args.benchmark}: {len(rows)} {split} rows -> {out[split]}"
              f"{' (placeholder prompts)' if args.no_render else ''}")
    for note in plan.notes:
        print(f"{args.benchmark}: note: {note}")
    print(f"{args.benchmark}: sandbox config in every row: {json.dumps(plan.sandbox_config, sort_keys=True)}")
    return out


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a plain string such as a path


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m verl_bpo.data.prepare",
                                  description=__doc__.split("\n")[0].rstrip(":"))
    sub = top.add_subparsers(dest="benchmark", required=True)
    for name, (add_args, _, defaults) in BENCHMARKS.items():
        p = sub.add_parser(name, help=f"{name} tasks; sandbox defaults {json.dumps(defaults)}")
        p.add_argument("--out", required=True, help="output folder: OUT/train.parquet and OUT/val.parquet")
        p.add_argument("--no-render", action="store_true",
                       help="placeholder prompts instead of a sandbox reset per task (see the module docstring)")
        p.add_argument("--sandbox-config", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                       help="extra keys of the adapter's Config (JSON values), repeatable; stored in every row")
        p.add_argument("--max-train", type=int, help="keep only the first N train tasks")
        p.add_argument("--max-val", type=int, help="keep only the first N val tasks")
        p.add_argument("--seed", type=int, default=0, help="seed of the --generate data")
        add_args(p)
    return top


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    args = parser().parse_args(argv)
    args.sandbox_config = dict(args.sandbox_config)
    args.out = os.path.abspath(os.path.expanduser(args.out))
    try:
        return prepare(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"prepare_data: {exc}")


if __name__ == "__main__":
    main()
