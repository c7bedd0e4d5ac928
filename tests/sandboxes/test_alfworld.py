"""ALFWorld adapter on the real engine: conformance, SAS snapshot == replay, the six task types, data layout."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil

import pytest

pytest.importorskip("alfworld", reason="alfworld is not installed (pip install -e .[envs])")
pytest.importorskip("fast_downward", reason="fast-downward-textworld is not installed (pip install -e .[envs])")

from sandbox_adapters.alfworld import ALFWorldSandbox, game_walkthrough, resolve_games_dir  # noqa: E402
from sandbox_adapters.alfworld import sandbox as alfworld_adapter  # noqa: E402
from sandbox_adapters.alfworld.gen import TASK_TYPES, find_games, generate_games, write_problems  # noqa: E402
from sandbox_adapters.registry import get_sandbox_cls  # noqa: E402
from tests.sandboxes.conformance import SandboxConformance, transcript  # noqa: E402

pytestmark = pytest.mark.envs
# `slow` (outside the fast tier): the conformance suites and the tests that play many episodes; the fast tier
# keeps one engine episode and the checks around the game files.


@pytest.fixture(scope="session")
def alf_root(tmp_path_factory):
    """Six train games (one per task type) and one valid_seen game, made by the real alfworld-generate (~5 s)."""
    root = tmp_path_factory.mktemp("alfworld_data")
    write_problems(root, seeds=[0])
    write_problems(root, seeds=[1], task_types=TASK_TYPES[:1], split="valid_seen")
    # in place (save path == data path): the script's y/n confirmation must be answered
    generate_games(root / "json_2.1.1")
    return root


@pytest.fixture(scope="session")
def alf_games(alf_root):
    games = {}
    for game in find_games(resolve_games_dir(alf_root, "train")):
        games[json.loads((game.parent / "traj_data.json").read_text())["task_type"]] = str(game)
    return games


@pytest.mark.slow
class TestALFWorldConformance(SandboxConformance):
    config = ALFWorldSandbox.Config()
    many_restores = 4
    # A reset in a fresh engine process parses the game's PDDL: past 3 s on a 2-core box under load
    sampler_step_timeout_s = 8.0

    @pytest.fixture(autouse=True)
    def _game(self, alf_games):
        self.game = alf_games["pick_heat_then_place_in_recep"]
        self.walkthrough = game_walkthrough(self.game)

    def make_sandbox(self):
        return ALFWorldSandbox(self.config)

    def task(self):
        return {"game": self.game}

    def prefix_actions(self):
        return self.walkthrough[:2]

    def probe_actions(self):
        return ["look", *self.walkthrough[2:]]

    def other_action(self):
        return "inventory"

    def inject_step_crash(self, sandbox):
        def broken(commands):
            raise RuntimeError("planner library crashed")

        sandbox._engine.step = broken


class TestALFWorldReplayConformance(TestALFWorldConformance):
    config = ALFWorldSandbox.Config(snapshot="replay")
    many_restores = 2

    def corrupt_snapshot(self, snapshot):
        return dataclasses.replace(snapshot, task={"game": "/nonexistent/game.tw-pddl"})


def _branch_runs(game, prefix, branches, mode):
    """Each branch from a restored fork of ``prefix``: transcript, then the engine's facts and admissible list."""
    parent = ALFWorldSandbox(ALFWorldSandbox.Config(snapshot=mode))
    child = ALFWorldSandbox(ALFWorldSandbox.Config(snapshot=mode))
    try:
        parent.reset({"game": game})
        for action in prefix:
            parent.step(action)
        snap = parent.snapshot()
        runs = []
        for branch in branches:
            child.restore(snap)  # the same child, restored again for every branch
            results = []
            for action in branch:
                results.append(child.step(action))
                if results[-1].done:
                    break
            facts = sorted(map(str, child._pddl._pddl_state.facts))
            runs.append((transcript(results), facts, results[-1].info["admissible_commands"]))
        return runs
    finally:
        parent.close()
        child.close()


@pytest.mark.slow
@pytest.mark.parametrize("fork_at", [1, 4])
def test_sas_snapshot_equals_replay(alf_games, fork_at):
    """The SAS restore touches private TextWorld/fast-downward state; replay from reset is the reference."""
    game = alf_games["pick_two_obj_and_place"]
    walkthrough = game_walkthrough(game)
    with ALFWorldSandbox() as probe:
        probe.reset({"game": game})
        admissible = [probe.step(a) for a in walkthrough[:fork_at]][-1].info["admissible_commands"]
    branches = [[command, *walkthrough[fork_at:]] for command in admissible[:3]] + [walkthrough[fork_at:]]
    fast = _branch_runs(game, walkthrough[:fork_at], branches, "sas")
    reference = _branch_runs(game, walkthrough[:fork_at], branches, "replay")
    assert fast == reference
    assert fast[-1][0][-1][1:] == (1.0, True), "the walkthrough branch must win"
    assert len({tuple(run[1]) for run in fast}) > 1, "branches should reach different states"


@pytest.mark.slow
@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_every_task_type_is_won_by_its_expert_plan(alf_games, task_type):
    game = alf_games[task_type]
    with ALFWorldSandbox() as sandbox:
        obs = sandbox.reset({"game": game})
        assert "Your task is to:" in obs.text and "Admissible commands:" in obs.text
        results = [sandbox.step(a) for a in game_walkthrough(game)]
    assert [r.done for r in results] == [False] * (len(results) - 1) + [True]
    assert [r.reward for r in results] == [0.0] * (len(results) - 1) + [1.0]
    assert results[-1].info["won"] is True
    assert not any(r.info["invalid_action"] for r in results)


def test_wrong_commands_are_flagged_and_max_steps_truncates(alf_games):
    with ALFWorldSandbox(ALFWorldSandbox.Config(max_steps=2)) as sandbox:
        sandbox.reset({"game": alf_games["pick_and_place_simple"]})
        first = sandbox.step("fly to the moon")
        assert first.info["invalid_action"] and first.observation.text.startswith("Nothing happens.")
        assert (first.reward, first.done) == (0.0, False)
        second = sandbox.step("look")
        assert not second.info["invalid_action"]
        assert second.done and second.info["truncated"] and not second.info["won"]
    with ALFWorldSandbox(ALFWorldSandbox.Config(max_steps=2)) as sandbox:
        sandbox.reset({"game": alf_games["pick_and_place_simple"]})
        assert not sandbox.step("").done  # a turn without a command counts as a step too
        last = sandbox.step("no command\nhere")
        assert last.done and last.info["truncated"] and last.info["invalid_action"] and last.reward == 0.0


def test_alfworld_data_env_var_and_splits(alf_root, alf_games, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(alf_root))
    train = ALFWorldSandbox()
    assert sorted(map(str, train.games())) == sorted(alf_games.values())
    valid = ALFWorldSandbox(ALFWorldSandbox.Config(split="valid_seen"))
    assert len(valid.games()) == 1 and "valid_seen" in str(valid.games()[0])
    only_heat = ALFWorldSandbox(ALFWorldSandbox.Config(task_types=("pick_heat_then_place_in_recep",)))
    try:
        obs = only_heat.reset({"task_id": 0})
        assert "heat" in obs.text.lower() or "hot" in obs.text.lower()
        with pytest.raises(ValueError, match="out of range"):
            only_heat.reset({"task_id": 1})
    finally:
        only_heat.close()
    monkeypatch.delenv("ALFWORLD_DATA")
    with pytest.raises(ValueError, match="ALFWORLD_DATA"):
        ALFWorldSandbox().games()


def test_games_dir_resolution(tmp_path):
    (tmp_path / "a" / "json_2.1.1" / "train").mkdir(parents=True)
    (tmp_path / "b" / "valid_unseen").mkdir(parents=True)
    assert resolve_games_dir(tmp_path / "a", "train") == tmp_path / "a" / "json_2.1.1" / "train"
    assert resolve_games_dir(tmp_path / "b", "valid_unseen") == tmp_path / "b" / "valid_unseen"
    assert resolve_games_dir(tmp_path / "b", "train") == tmp_path / "b"  # a flat folder of trials
    with pytest.raises(FileNotFoundError):
        resolve_games_dir(tmp_path / "missing", "train")


def test_relative_paths_are_where_the_sandbox_is_made(alf_root, alf_games, tmp_path, monkeypatch):
    """The engine process a sandbox is shipped to runs in a private directory: ``data_dir``, ``$ALFWORLD_DATA``
    and a task's relative game are resolved where the sandbox is made, and still hold after a move elsewhere."""
    import pickle

    monkeypatch.chdir(alf_root.parent)
    relative = os.path.relpath(alf_root)
    game = os.path.relpath(alf_games["pick_and_place_simple"])
    assert ALFWorldSandbox.Config(data_dir=relative).data_dir == str(alf_root)
    monkeypatch.setenv("ALFWORLD_DATA", relative)
    from_env, no_dir = ALFWorldSandbox(), ALFWorldSandbox()
    monkeypatch.chdir(tmp_path)  # as the engine process does, with the pickled sandbox
    from_env, no_dir = pickle.loads(pickle.dumps(from_env)), pickle.loads(pickle.dumps(no_dir))
    assert sorted(map(str, from_env.games())) == sorted(alf_games.values())
    monkeypatch.delenv("ALFWORLD_DATA")
    assert no_dir.resolve_game({"game": game}) == alf_games["pick_and_place_simple"]


def test_find_games_filters_like_alfworld(alf_root, alf_games, tmp_path):
    root = tmp_path / "json_2.1.1" / "train"
    source = alf_games["pick_and_place_simple"]
    trial = shutil.copytree(str(alf_games["pick_and_place_simple"]).rsplit("/", 1)[0], root / "plain" / "trial_0")
    shutil.copytree(trial, root / "pick_and_place_with_movable_recep-x" / "trial_0")
    unsolvable = shutil.copytree(trial, root / "unsolvable" / "trial_0")
    data = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**data, "solvable": False}))
    assert find_games(tmp_path) == [trial / "game.tw-pddl"]
    assert find_games(tmp_path, task_types=("look_at_obj_in_light",)) == []
    assert (trial / "game.tw-pddl").read_text() == open(source).read()


def test_problem_generator_is_deterministic(tmp_path, alf_root):
    first = write_problems(tmp_path / "one", seeds=[3])
    second = write_problems(tmp_path / "two", seeds=[3])
    for a, b in zip(first, second, strict=True):
        assert (a / "initial_state.pddl").read_bytes() == (b / "initial_state.pddl").read_bytes()
        assert (a / "traj_data.json").read_bytes() == (b / "traj_data.json").read_bytes()
    other = write_problems(tmp_path / "three", seeds=[4])
    assert (first[0] / "initial_state.pddl").read_bytes() != (other[0] / "initial_state.pddl").read_bytes()
    with pytest.raises(ValueError, match="unknown task type"):
        write_problems(tmp_path / "bad", seeds=[0], task_types=["juggle"])
    big = write_problems(tmp_path / "big", seeds=[3], task_types=TASK_TYPES[:1], cabinets=12, distractors=14)[0]
    problem = (big / "initial_state.pddl").read_text()
    assert len(re.findall(r"^    \S+ - receptacle$", problem, flags=re.MULTILINE)) == 30
    assert problem.count("(pickupable ") == 15  # the target and 14 distractors (the lamp is not pickupable)


@pytest.mark.slow
def test_closed_engines_are_recycled(alf_games):
    game = alf_games["pick_and_place_simple"]
    first = ALFWorldSandbox()
    first.reset({"game": game})
    engine = first._engine
    first.close()
    assert engine in alfworld_adapter._IDLE_ENGINES
    second = ALFWorldSandbox()
    try:
        obs = second.reset({"game": alf_games["look_at_obj_in_light"]})
        assert second._engine is engine
        assert "desklamp" in obs.text.split("Your task is to:")[1]
    finally:
        second.close()


@pytest.mark.slow
def test_failed_restore_discards_the_engine(alf_games):
    from sandbox_adapters.base import RestoreFailed

    with ALFWorldSandbox() as parent, ALFWorldSandbox() as child:
        parent.reset({"game": alf_games["pick_and_place_simple"]})
        snap = parent.snapshot()
        child.reset({"game": alf_games["look_at_obj_in_light"]})
        engine = child._engine
        broken = dataclasses.replace(snap, payload=dataclasses.replace(snap.payload, game="/nonexistent/game.tw-pddl"))
        with pytest.raises(RestoreFailed):
            child.restore(broken)
        assert child._engine is None and engine not in alfworld_adapter._IDLE_ENGINES
        child.restore(snap)  # a good snapshot brings up a working engine again
        assert child.step("look").observation.text == parent.step("look").observation.text


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("go to countertop 1", "go to countertop 1"),
        ("Think first.\nAction: Take Apple 1 from Countertop 1.", "take apple 1 from countertop 1"),
        ("<think>hmm</think><action>open fridge 1</action>", "open fridge 1"),
        ("", None),
        ("two\nlines", None),
    ],
)
def test_parse_action(text, action):
    assert ALFWorldSandbox().parse_action(text) == action


def test_registry_and_config():
    assert get_sandbox_cls("alfworld") is ALFWorldSandbox
    with pytest.raises(ValueError, match="task types"):
        ALFWorldSandbox.Config(task_types=("juggle",))
    with pytest.raises(ValueError, match="snapshot"):
        ALFWorldSandbox.Config(snapshot="fork")


@pytest.mark.slow
def test_forks_into_fresh_sandboxes_never_translate_the_pddl(alf_games, monkeypatch):
    """The sampler restores each child into a fresh sandbox: the game's loaded parts travel with the snapshot, so
    neither a new engine nor an idle engine of another game re-translates the PDDL (seconds on real scenes)."""
    from textworld.envs.pddl import logic as pddl_logic

    game, other = alf_games["pick_two_obj_and_place"], alf_games["look_at_obj_in_light"]
    walkthrough = game_walkthrough(game)
    with ALFWorldSandbox() as parent:
        parent.reset({"game": game})
        for action in walkthrough[:3]:
            parent.step(action)
        snap = parent.snapshot()
    with ALFWorldSandbox(ALFWorldSandbox.Config(snapshot="replay")) as reference:
        reference.restore(snap)
        expected = transcript([reference.step(a) for a in walkthrough[3:]])
    with ALFWorldSandbox() as idle:  # leaves an idle engine that holds another game
        idle.reset({"game": other})
    translations = []
    original = pddl_logic.PddlState.__init__
    monkeypatch.setattr(pddl_logic.PddlState, "__init__",
                        lambda self, *a, **kw: (translations.append(1), original(self, *a, **kw))[1])
    assert any(getattr(e, "_bpo_game", None) == other for e in alfworld_adapter._IDLE_ENGINES)
    with ALFWorldSandbox() as warm:  # takes the idle engine of the other game
        warm.restore(snap)
        assert transcript([warm.step(a) for a in walkthrough[3:]]) == expected
    monkeypatch.setattr(alfworld_adapter, "_IDLE_ENGINES", [])
    with ALFWorldSandbox() as cold:  # no idle engine: a new one, with its own planner library
        cold.restore(snap)
        assert transcript([cold.step(a) for a in walkthrough[3:]]) == expected
    assert expected[-1][1:] == (1.0, True) and not translations


@pytest.mark.slow
def test_closing_during_a_running_call_drops_the_engine(alf_games):
    """A sandbox quarantined after a hung call is closed while the call still runs: its engine must not be handed
    to another sandbox."""
    import threading

    release, entered = threading.Event(), threading.Event()
    sandbox = ALFWorldSandbox()
    sandbox.reset({"game": alf_games["pick_and_place_simple"]})
    engine = sandbox._engine
    step = engine.step

    def hanging(commands):
        entered.set()
        release.wait()
        return step(commands)

    engine.step = hanging
    def play():
        with contextlib.suppress(Exception):  # the step ends on a closed sandbox
            sandbox.step("look")

    worker = threading.Thread(target=play, daemon=True)
    worker.start()
    assert entered.wait(10)
    sandbox.close()
    assert engine not in alfworld_adapter._IDLE_ENGINES
    release.set()
    worker.join(10)
