"""What a fork costs per sandbox adapter on the sampler's own path, measured side by side in one run.

The tree sampler forks a node by taking one ``snapshot()`` of the branch's sandbox and restoring it into K - 1
**fresh** sandboxes (``make_sandbox()`` + ``restore()``), which then step. For every adapter in ``CASES`` whose
engine is installed, the script plays a prefix to a decision point on a realistic scene and then, round-robin in
the same loop (so machine noise hits all quantities alike), times:

* ``snapshot``: ``snapshot()`` of the parent;
* ``fork``: a fresh sandbox built and restored from that snapshot, as the sampler does it;
* ``step``: the probe action stepped on that freshly restored sandbox;
* ``warm``: ``restore()`` into a sandbox that already holds the game (the old, optimistic measure);
* ``cold``: the run's first fork, made before any sandbox of the adapter was closed, so no idle engine can be
  recycled (TextWorld and ALFWorld then start a new engine: a Z-machine, a planner library);
* ``replay``: the universal fallback, ``reset`` + re-applying the prefix in a fresh episode.

and prints a table with the medians, then, as the last stdout line, exactly one JSON object::

    {"<adapter>": {"fork_over_step": <(median(snapshot) + median(fork)) / median(step)>,
                   "target": <the adapter's target>, "within_target": <bool>,
                   "cold_fork_over_step": <(median(snapshot) + cold) / median(step)>,
                   "replay_over_fork": <median(replay) / median(fork)>}, ...}

``swebench-docker`` also reports ``docker_step_over_local``: median(step) over the median step of the same scene on
the local backend, timed in the same loop, with ``docker_step_target`` (2.0) and ``docker_step_within_target``.

Targets for ``fork_over_step``: <= 0.5 for textworld, swebench (every backend) and webshop, <= 1 for alfworld
(the smoke corridor has none: it steps in microseconds).

Adding an adapter: decorate a function ``(work_dir, quick) -> Case`` with ``@case("<name>", requires=(modules))``.
Adapters whose required modules (or, for ``swebench-docker``, a running Docker engine) are missing are skipped
with a note on stderr.

Usage: ``python benchmarks/snapshot_cost.py [--quick] [--only smoke,textworld] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

from sandbox_adapters.base import Sandbox  # noqa: E402


@dataclasses.dataclass
class Case:
    """One adapter's benchmark set-up.

    Attributes:
        make: builds a new sandbox (all sandboxes of a case share its configuration).
        task: the task to reset with.
        prefix: actions from reset to the decision point (must not end the episode).
        probe: the action stepped at the decision point (may end the episode).
        note: what the scene is, for the table.
        local: the same scene on the local backend, whose step is timed in the same loop (the Docker case's
            ``docker_step_over_local``).
    """

    make: Callable[[], Sandbox]
    task: Mapping[str, Any]
    prefix: Sequence[str]
    probe: str
    note: str = ""
    local: Case | None = None


CASES: dict[str, tuple[tuple[str, ...], Callable[[Path, bool], Case]]] = {}


class Unavailable(RuntimeError):
    """A case's engine is installed but cannot run here (e.g. no Docker engine); the case is skipped."""


def case(name: str, requires: tuple[str, ...] = ()):
    """Register a benchmark set-up under the adapter's registry name."""

    def decorator(fn: Callable[[Path, bool], Case]) -> Callable[[Path, bool], Case]:
        CASES[name] = (requires, fn)
        return fn

    return decorator


@case("smoke")
def _smoke(work_dir: Path, quick: bool) -> Case:
    from sandbox_adapters.smoke import SmokeSandbox

    config = SmokeSandbox.Config(length=8, max_steps=40)
    task = {"task_id": 4}
    solution = SmokeSandbox(config).solution(task)
    note = f"corridor of 8, {len(solution)} steps"
    return Case(lambda: SmokeSandbox(config), task, solution[:-1], solution[-1], note)


@case("textworld", requires=("textworld", "jericho"))
def _textworld(work_dir: Path, quick: bool) -> Case:
    from sandbox_adapters.textworld import TextWorldSandbox, game_walkthrough, make_games

    # a mid-sized game: a dozen rooms, objects to track, a quest of several steps
    size = dict(world_size=4, nb_objects=10, quest_length=5)
    if not quick:
        size = dict(world_size=10, nb_objects=25, quest_length=8)
    game = str(make_games(work_dir / "textworld", [7], **size)[0])
    walkthrough = game_walkthrough(game)
    return Case(
        TextWorldSandbox,
        {"game": game},
        walkthrough[:-1],
        walkthrough[-1],
        f"tw-make {size['world_size']} rooms, {size['nb_objects']} objects, fork at step {len(walkthrough) - 1}",
    )


@case("alfworld", requires=("alfworld", "fast_downward", "textworld"))
def _alfworld(work_dir: Path, quick: bool) -> Case:
    from sandbox_adapters.alfworld import ALFWorldSandbox, game_walkthrough
    from sandbox_adapters.alfworld.gen import generate_games, write_problems

    # full runs use ALFWorld-sized kitchens: 12 cabinets + 12 drawers + 6 other receptacles, 16 objects
    cabinets, distractors = (1, 3) if quick else (12, 14)
    write_problems(
        work_dir / "alfworld", seeds=[0], task_types=["pick_two_obj_and_place"], cabinets=cabinets,
        distractors=distractors,
    )  # fmt: skip
    game = str(generate_games(work_dir / "alfworld" / "json_2.1.1")[0])
    walkthrough = game_walkthrough(game)
    return Case(
        ALFWorldSandbox,
        {"game": game},
        walkthrough[:-1],
        walkthrough[-1],
        f"generated pick_two scene ({6 + 2 * cabinets} receptacles), fork at step {len(walkthrough) - 1}",
    )


def _swebench_case(work_dir: Path, backend: str, docker: bool = False) -> Case:
    from sandbox_adapters.swebench import SWEBenchSandbox
    from sandbox_adapters.swebench.tasks import generate_tasks

    out = work_dir / f"swebench-{backend}{'-docker' if docker else ''}"
    task = generate_tasks(str(out), num=1)[0]
    task["repo_path"] = str(out / "repos" / task["instance_id"])
    config = SWEBenchSandbox.Config(snapshot_backend=backend)
    local_task = dict(task)
    if docker:
        import os
        import subprocess

        from sandbox_adapters.swebench.docker import build_instance_image, docker_available

        base = os.environ.get("BPO_SWE_BASE_IMAGE", "bpo/swe-base:bookworm")
        if not docker_available():
            raise Unavailable("no Docker engine answers (scripts/setup.sh starts dockerd)")
        if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
            raise Unavailable(f"the SWE base image {base} is missing (scripts/setup.sh builds it)")
        task["image"] = build_instance_image("bpo-local/sweb.eval.x86_64.snapshot-cost:latest", task.pop("repo_path"),
                                             base)
        config = SWEBenchSandbox.Config(backend="docker", snapshot_backend=backend,
                                        docker_cache_dir=str(out / "testbeds"))
    # a typical agent step at a fork: edit the code, then run the tests
    fix = "sed -i 's/len(values) - size)/len(values) - size + 1)/' pkg0/windows.py"
    probe = f"```bash\n{fix} && python -m pytest -q\n```"
    prefix = ["```bash\ngrep -rn 'def ' pkg0\n```", "```bash\necho '# notes' >> README.md\n```"]
    where = "in its Docker image" if docker else "bubblewrap"
    local_config = SWEBenchSandbox.Config(snapshot_backend=backend)
    local = Case(lambda: SWEBenchSandbox(local_config), local_task, prefix, probe) if docker else None
    return Case(lambda: SWEBenchSandbox(config), task, prefix, probe,
                f"generated repo + .git, {where}, {backend} snapshots; probe = sed edit + pytest", local)


@case("swebench", requires=("swebench",))
def _swebench(work_dir: Path, quick: bool) -> Case:
    from sandbox_adapters.swebench.workspace import overlay_supported

    return _swebench_case(work_dir, "overlay" if overlay_supported() else "memory")


@case("swebench-memory", requires=("swebench",))
def _swebench_memory(work_dir: Path, quick: bool) -> Case:
    return _swebench_case(work_dir, "memory")


@case("swebench-docker", requires=("swebench",))
def _swebench_docker(work_dir: Path, quick: bool) -> Case:
    from sandbox_adapters.swebench.workspace import overlay_supported

    return _swebench_case(work_dir, "overlay" if overlay_supported() else "memory", docker=True)


@case("webshop")
def _webshop(work_dir: Path, quick: bool) -> Case:
    from sandbox_adapters.webshop import WebShopSandbox
    from sandbox_adapters.webshop.data import generate_catalogue

    generate_catalogue(str(work_dir / "webshop"), num=30)
    config = WebShopSandbox.Config(engine="fake", data_dir=str(work_dir / "webshop"))
    goal = WebShopSandbox(config)._env.server.goals[0]
    query = goal["instruction_text"].split(",")[0].removeprefix("i am looking for ")
    prefix = [f"search[{query}]", f"click[{goal['asin']}]", f"click[{goal['goal_options'][0]}]"]
    return Case(lambda: WebShopSandbox(config), {"goal_index": 0}, prefix, f"click[{goal['goal_options'][1]}]",
                "FAKE engine (webshop.fake), 30 products; the real web_agent_site needs a user checkout")


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(bench: Case, repeats: int) -> dict[str, float]:
    """Medians (seconds) of snapshot, fork (fresh sandbox + restore), step, warm restore and replay, plus
    ``local_step``: the step of ``bench.local`` (same scene, local backend), timed in the same loop."""
    parent, warm, replayer = bench.make(), bench.make(), bench.make()
    local_parent = bench.local.make() if bench.local is not None else None
    try:
        parent.reset(bench.task)
        for action in bench.prefix:
            parent.step(action)
        snap = parent.snapshot()
        if local_parent is not None:
            local_parent.reset(bench.local.task)
            for action in bench.local.prefix:
                local_parent.step(action)
            local_snap = local_parent.snapshot()
        # the first fork of the run finds no idle engine of the adapter to recycle: the cold case
        cold = _timed(lambda: warm.restore(snap))  # the warm sandbox holds the game from here on
        samples: dict[str, list[float]] = {name: [] for name in ("snapshot", "fork", "step", "warm", "replay")}
        if local_parent is not None:
            samples["local_step"] = []
        for _ in range(repeats):
            if local_parent is not None:  # the local step on a freshly restored sandbox, as the step below
                local = bench.local.make()
                local.restore(local_snap, 1234)
                samples["local_step"].append(_timed(lambda: local.step(bench.local.probe)))
                local.close()
            extra: list[Any] = []
            samples["snapshot"].append(_timed(lambda: extra.append(parent.snapshot())))
            fresh: list[Sandbox] = []

            def fork() -> None:
                fresh.append(bench.make())
                fresh[0].restore(extra[0], 1234)

            samples["fork"].append(_timed(fork))
            samples["step"].append(_timed(lambda: fresh[0].step(bench.probe)))
            fresh[0].close()
            extra[0].close()
            samples["warm"].append(_timed(lambda: warm.restore(snap)))

            def replay() -> None:
                replayer.reset(bench.task)
                for action in bench.prefix:
                    replayer.step(action)

            samples["replay"].append(_timed(replay))
        snap.close()
        if local_parent is not None:
            local_snap.close()
    finally:
        for sandbox in (parent, warm, replayer, local_parent):
            if sandbox is not None:
                sandbox.close()
    return {"cold": cold, **{name: statistics.median(values) for name, values in samples.items()}}


#: ``fork_over_step`` targets (the rest default to 0.5; the smoke corridor steps in microseconds and has none).
TARGETS = {"alfworld": 1.0, "smoke": None}
#: ``docker_step_over_local`` target: a step in the instance's container at most twice a local (bubblewrap) step.
DOCKER_STEP_TARGET = 2.0


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small scenes and few repeats (a smoke run)")
    parser.add_argument("--only", default="", help="comma-separated adapter names (default: all available)")
    parser.add_argument("--repeats", type=int, default=0, help="samples per quantity (default 5 quick, 15 full)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown adapters {unknown}; known: {sorted(CASES)}")

    work_dir = Path(tempfile.mkdtemp(prefix="bpo-snapshot-cost-"))
    results: dict[str, dict[str, Any]] = {}
    rows = []
    try:
        for name in names:
            requires, build = CASES[name]
            missing = [m for m in requires if importlib.util.find_spec(m) is None]
            if missing:
                print(f"skipping {name}: {', '.join(missing)} not installed", file=sys.stderr)
                continue
            try:
                bench = build(work_dir, args.quick)
            except Unavailable as exc:
                print(f"skipping {name}: {exc}", file=sys.stderr)
                continue
            med = measure(bench, repeats)
            ratio = (med["snapshot"] + med["fork"]) / med["step"]
            target = TARGETS.get(name, 0.5)
            results[name] = {
                "fork_over_step": round(ratio, 4),
                "target": target,
                "within_target": None if target is None else ratio <= target,
                "cold_fork_over_step": round((med["snapshot"] + med["cold"]) / med["step"], 4),
                "replay_over_fork": round(med["replay"] / med["fork"], 2),
            }
            if "local_step" in med:  # the Docker backend's step against the local one, same task, same loop
                over = med["step"] / med["local_step"]
                results[name].update(docker_step_over_local=round(over, 4), docker_step_target=DOCKER_STEP_TARGET,
                                     docker_step_within_target=over <= DOCKER_STEP_TARGET)
            rows.append((name, med, results[name], bench.note))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    print(f"{'adapter':<17}{'step ms':>9}{'snap ms':>9}{'fork ms':>9}{'cold ms':>9}{'warm ms':>9}"
          f"{'replay ms':>11}{'fork/step':>11}{'target':>8}  scene")  # fmt: skip
    for name, med, ratio, note in rows:
        print(
            f"{name:<17}{med['step'] * 1e3:>9.2f}{med['snapshot'] * 1e3:>9.2f}{med['fork'] * 1e3:>9.2f}"
            f"{med['cold'] * 1e3:>9.2f}{med['warm'] * 1e3:>9.2f}{med['replay'] * 1e3:>11.1f}"
            f"{ratio['fork_over_step']:>11.3f}{'-' if ratio['target'] is None else ratio['target']:>8}  {note}"
        )
    print(json.dumps(results, sort_keys=True))
    return results


if __name__ == "__main__":
    main()
