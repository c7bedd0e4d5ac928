"""Our own generator of small ALFRED-format problems, turned into ALFWorld games by the real ``alfworld-generate``.

ALFWorld's scenes (``json_2.1.1``) are only distributed through GitHub releases, which CI cannot reach. ALFWorld's
text engine, however, only needs per game an ``initial_state.pddl`` (the ALFRED PDDL problem: mangled object ids
such as ``Apple_bar__minus_01_dot_66_bar__plus_00_dot_93_bar__minus_02_dot_15``, ``loc_bar_...`` locations and the
facts of ``alfworld/data/alfred.pddl``) and a ``traj_data.json`` (``task_type``, ``pddl_params`` and
``turk_annotations``). ``write_problems`` writes such pairs for all six ALFWorld task types into the official layout
``<root>/json_2.1.1/<split>/<task>-<Object>-None-<Receptacle>-<scene>/trial_<seed>/``; ``generate_games`` then runs
the unmodified ``alfworld-generate`` script on them, which adds ``game.tw-pddl`` with the planner's walkthrough.

Scenes are tiny by default (eight receptacles, a handful of objects) so a reset costs a fraction of a second;
``cabinets``/``distractors`` scale them up to ALFWorld's size for benchmarks. Everything is a pure function of
the seed and the size parameters.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["TASK_TYPES", "write_problems", "generate_games", "find_games", "mangle"]

# The six task types of ALFWorld (alfworld-generate's TASK_TYPES), in ALFWorld's numbering order.
TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# Receptacle type -> openable. Sink, microwave and fridge are required by clean/heat/cool; the desk holds the lamp.
_RECEPTACLES: dict[str, bool] = {
    "CounterTop": False,
    "DiningTable": False,
    "Desk": False,
    "SinkBasin": False,
    "Cabinet": True,
    "Drawer": True,
    "Fridge": True,
    "Microwave": True,
}
# Object type -> properties beyond "pickupable".
_OBJECTS: dict[str, frozenset[str]] = {
    "Apple": frozenset({"cleanable", "heatable", "coolable"}),
    "Potato": frozenset({"cleanable", "heatable", "coolable"}),
    "Egg": frozenset({"heatable", "coolable"}),
    "Tomato": frozenset({"cleanable", "heatable", "coolable"}),
    "Plate": frozenset({"cleanable", "coolable"}),
    "Lettuce": frozenset({"cleanable", "coolable"}),
    "Book": frozenset(),
    "CD": frozenset(),
    "Pen": frozenset(),
}
_LAMP = "DeskLamp"
# Types the domain names as constants (CleanObject/HeatObject/CoolObject/SliceObject): always declared.
_EXTRA_OTYPES = ("Knife", "ButterKnife")
# Where placing the target would make a task trivial or odd.
_NOT_A_TARGET = {"SinkBasin", "Microwave", "Fridge"}
_NEEDS_PROPERTY = {
    "pick_clean_then_place_in_recep": "cleanable",
    "pick_heat_then_place_in_recep": "heatable",
    "pick_cool_then_place_in_recep": "coolable",
}


def mangle(name: str) -> str:
    """ALFRED's PDDL id of a name like ``Apple|-01.66|+00.93|-02.15``."""
    for char, word in (("|", "_bar_"), ("-", "_minus_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(char, word)
    return name


def _coords(rng: random.Random) -> str:
    return "|".join(f"{rng.uniform(-3, 3):+06.2f}" for _ in range(3))


def _location(rng: random.Random) -> str:
    x, z, rot, horizon = rng.randint(-12, 12), rng.randint(-12, 12), rng.choice((0, 1, 2, 3)), rng.choice((0, 30, 45))
    return mangle(f"loc|{x}|{z}|{rot}|{horizon}")


def _problem(task_type: str, seed: int, cabinets: int = 1, distractors: int = 3) -> tuple[str, dict]:
    """The ``initial_state.pddl`` text and ``traj_data.json`` dict of one task."""
    from alfworld.gen import goal_library

    rng = random.Random(f"{task_type}/{seed}")
    receptacles: dict[str, tuple[str, str]] = {}  # PDDL id -> (type, location)
    used_locations: set[str] = set()
    # kitchens have many cabinets and drawers; they are what makes real ALFWorld scenes large
    instances: list[str] = []
    for rtype in _RECEPTACLES:
        instances += [rtype] * (cabinets if rtype in ("Cabinet", "Drawer") else 1)
    for rtype in instances:
        loc = _location(rng)
        while loc in used_locations:
            loc = _location(rng)
        used_locations.add(loc)
        name = f"{rtype}|{_coords(rng)}"
        if rtype == "SinkBasin":  # ALFRED's sink basin id; the demangler names it "sinkbasin"
            name = f"Sink|{_coords(rng)}|SinkBasin"
        receptacles[mangle(name)] = (rtype, loc)
    start = _location(rng)
    while start in used_locations:
        start = _location(rng)

    needed = _NEEDS_PROPERTY.get(task_type)
    candidates = [o for o, props in _OBJECTS.items() if needed is None or needed in props]
    if task_type == "look_at_obj_in_light":
        candidates = [o for o in _OBJECTS if not _OBJECTS[o]]
    target_obj = rng.choice(candidates)
    target_recep = rng.choice([r for r in _RECEPTACLES if r not in _NOT_A_TARGET and r != "Desk"])
    others = [o for o in _OBJECTS if o != target_obj]
    placed = [target_obj, target_obj] if task_type == "pick_two_obj_and_place" else [target_obj]
    placed += [rng.choice(others) for _ in range(distractors)]

    # objects start anywhere but in the target receptacle and never inside an appliance the task needs
    start_receps = [
        rid for rid, (rtype, _) in receptacles.items() if rtype != target_recep and rtype not in _NOT_A_TARGET
    ]
    objects: dict[str, tuple[str, str]] = {}  # PDDL id -> (type, receptacle id)
    for otype in placed:
        objects[mangle(f"{otype}|{_coords(rng)}")] = (otype, rng.choice(start_receps))
    desk = next(rid for rid, (rtype, _) in receptacles.items() if rtype == "Desk")
    objects[mangle(f"{_LAMP}|{_coords(rng)}")] = (_LAMP, desk)

    otypes = sorted({*_OBJECTS, _LAMP, *_EXTRA_OTYPES})
    lines = [f"(define (problem plan_trial_{task_type}_{seed})", "(:domain alfred)", "(:objects", "    agent1 - agent"]
    lines += [f"    {o}Type - otype" for o in otypes]
    lines += [f"    {r}Type - rtype" for r in sorted(_RECEPTACLES)]
    lines += [f"    {oid} - object" for oid in objects]
    lines += [f"    {rid} - receptacle" for rid in receptacles]
    lines += [f"    {loc} - location" for loc in sorted({start, *(loc for _, loc in receptacles.values())})]
    lines += ["    )", "", "(:init", "    (= (total-cost) 0)", f"    (atLocation agent1 {start})"]
    for rid, (rtype, loc) in receptacles.items():
        lines += [f"    (receptacleType {rid} {rtype}Type)", f"    (receptacleAtLocation {rid} {loc})"]
        if _RECEPTACLES[rtype]:
            lines.append(f"    (openable {rid})")
        lines += [f"    (canContain {rtype}Type {otype}Type)" for otype in sorted(_OBJECTS)]
    for oid, (otype, rid) in objects.items():
        loc = receptacles[rid][1]
        lines += [f"    (objectType {oid} {otype}Type)", f"    (inReceptacle {oid} {rid})"]
        lines.append(f"    (objectAtLocation {oid} {loc})")
        if otype == _LAMP:
            lines.append(f"    (toggleable {oid})")
        else:
            lines.append(f"    (pickupable {oid})")
            lines += [f"    ({prop} {oid})" for prop in sorted(_OBJECTS[otype])]
    lines += ["    )", ""]
    goal = goal_library.gdict[task_type]["pddl"].replace("#", "-")
    goal = goal.format(obj=target_obj, recep=target_recep, toggle=_LAMP)
    problem = "\n".join(lines) + goal + "\n"

    params = {
        "object_target": target_obj,
        "parent_target": "" if task_type == "look_at_obj_in_light" else target_recep,
        "toggle_target": _LAMP if task_type == "look_at_obj_in_light" else "",
        "mrecep_target": "",
        "object_sliced": False,
    }
    traj = {
        "task_type": task_type,
        "task_id": f"{task_type}_{seed}",
        "pddl_params": params,
        "scene": {"floor_plan": f"Generated{seed}", "random_seed": seed},
        "turk_annotations": {"anns": [{"task_desc": f"{task_type.replace('_', ' ')} ({target_obj})"}]},
    }
    return problem, traj


def write_problems(
    root: str | os.PathLike,
    seeds: Iterable[int],
    task_types: Sequence[str] = TASK_TYPES,
    split: str = "train",
    *,
    cabinets: int = 1,
    distractors: int = 3,
) -> list[Path]:
    """Write one problem per (task type, seed) under ``root/json_2.1.1/<split>/``; return the trial dirs.

    ``cabinets`` is the number of cabinets and of drawers (default 1: eight receptacles in all; 12 gives a
    30-receptacle scene like ALFWorld's kitchens) and ``distractors`` the number of non-target objects.
    """
    if cabinets < 1 or distractors < 0:
        raise ValueError("alfworld: cabinets must be >= 1 and distractors >= 0")
    out = []
    for task_type in task_types:
        if task_type not in TASK_TYPES:
            raise ValueError(f"alfworld: unknown task type {task_type!r}; choose from {TASK_TYPES}")
        for seed in seeds:
            problem, traj = _problem(task_type, seed, cabinets, distractors)
            p = traj["pddl_params"]
            recep = p["parent_target"] or p["toggle_target"]
            trial = (
                Path(root) / "json_2.1.1" / split / f"{task_type}-{p['object_target']}-None-{recep}-{seed}"
                / f"trial_{seed:05d}"
            )
            trial.mkdir(parents=True, exist_ok=True)
            (trial / "initial_state.pddl").write_text(problem)
            (trial / "traj_data.json").write_text(json.dumps(traj, indent=1, sort_keys=True))
            out.append(trial)
    return out


# alfworld-generate picks templated goal sentences with the global `random`; seeding it first makes the game files
# reproducible. The script itself runs unmodified.
_RUN_GENERATE = (
    "import random, runpy, sys; random.seed(0); sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def generate_games(data_path: str | os.PathLike, save_path: str | os.PathLike | None = None) -> list[Path]:
    """Run the real ``alfworld-generate`` (planner expert) on every problem under ``data_path``.

    ``save_path`` defaults to ``data_path`` itself; the script then asks for a y/n confirmation before writing next
    to its inputs, which we answer. Returns the solvable ``game.tw-pddl`` files found afterwards.
    """
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    data_path = Path(data_path).resolve()
    save_path = Path(save_path).resolve() if save_path else data_path
    script = Path(sys.executable).with_name("alfworld-generate")
    args = [
        sys.executable, "-c", _RUN_GENERATE, str(script), "--data_path", str(data_path), "--save_path",
        str(save_path), "--expert_type", "planner", "--domain", ALFRED_PDDL_PATH, "--grammar", ALFRED_TWL2_PATH,
        "--start", "0", "--end", str(10**9),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "TQDM_DISABLE": "1"}
    proc = subprocess.run(args, input="y\n", capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"alfworld-generate failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return find_games(save_path)


def find_games(root: str | os.PathLike, task_types: Sequence[str] = TASK_TYPES) -> list[Path]:
    """Solvable ``game.tw-pddl`` files under ``root`` in sorted order, filtered like ALFWorld's ``AlfredTWEnv``.

    Trials whose path mentions ``movable`` or ``Sliced`` are skipped (ALFWorld does not support them), as are games
    whose ``traj_data.json`` has another task type or whose game file is not marked solvable.
    """
    games = []
    for game in sorted(Path(root).rglob("game.tw-pddl")):
        trial = game.parent
        if "movable" in str(trial) or "Sliced" in str(trial) or not (trial / "traj_data.json").exists():
            continue
        traj = json.loads((trial / "traj_data.json").read_text())
        if traj.get("task_type") not in task_types:
            continue
        if not json.loads(game.read_text()).get("solvable"):
            continue
        games.append(game)
    return games
