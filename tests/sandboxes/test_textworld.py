"""TextWorld adapter on the real engine: conformance, in-place snapshot == ``env.copy()``, rewards and tasks."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

pytest.importorskip("textworld", reason="textworld is not installed (pip install -e .[envs])")
pytest.importorskip("jericho", reason="jericho is not installed (pip install -e .[envs])")

from sandbox_adapters.base import SnapshotKind  # noqa: E402
from sandbox_adapters.registry import get_sandbox_cls, make_sandbox  # noqa: E402
from sandbox_adapters.textworld import TextWorldSandbox, game_walkthrough, make_games  # noqa: E402
from tests.sandboxes.conformance import SandboxConformance, transcript  # noqa: E402

pytestmark = pytest.mark.envs
# `slow` (outside the fast tier): the conformance suites, the snapshot sweeps and regenerating games; the fast
# tier keeps single episodes on the two session games.

SEEDS = (1, 2)


@pytest.fixture(scope="session")
def tw_games(tmp_path_factory):
    """Two small ``tw-make`` games with fixed seeds (about 5 s, compiled in parallel)."""
    return make_games(tmp_path_factory.mktemp("tw_games"), SEEDS)


@pytest.mark.slow
class TestTextWorldConformance(SandboxConformance):
    config = TextWorldSandbox.Config()

    @pytest.fixture(autouse=True)
    def _game(self, tw_games):
        self.game = str(tw_games[0])
        self.walkthrough = game_walkthrough(self.game)

    def make_sandbox(self):
        return TextWorldSandbox(self.config)

    def task(self):
        return {"game": self.game}

    def prefix_actions(self):
        return self.walkthrough[:1]

    def probe_actions(self):
        return ["look", *self.walkthrough[1:]]

    def other_action(self):
        return "inventory"

    def inject_step_crash(self, sandbox):
        def broken(command):
            raise OSError("interpreter died")

        sandbox._env.step = broken


class TestTextWorldReplayConformance(TestTextWorldConformance):
    config = TextWorldSandbox.Config(snapshot="replay")
    many_restores = 3

    def corrupt_snapshot(self, snapshot):
        return dataclasses.replace(snapshot, task={"game": "/nonexistent/game.z8"})


def _fork_transcripts(game, prefix, branches, snapshot_mode):
    """Play ``prefix``, snapshot, then play every branch from its own restored sandbox."""
    parent = TextWorldSandbox(TextWorldSandbox.Config(snapshot=snapshot_mode))
    parent.reset({"game": game})
    for action in prefix:
        parent.step(action)
    snap = parent.snapshot()
    out = []
    try:
        for branch in branches:
            child = TextWorldSandbox(TextWorldSandbox.Config(snapshot=snapshot_mode))
            child.restore(snap)
            results = []
            for action in branch:
                results.append(child.step(action))
                if results[-1].done:
                    break
            out.append([(r.observation.text, r.reward, r.done, dict(r.info)) for r in results])
            child.close()
        # the parent continues after its children, in both modes
        out.append(transcript([parent.step(a) for a in branches[0][:2]]))
    finally:
        snap.close()
        parent.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("game_index", [0, 1])
@pytest.mark.parametrize("fork_at", [0, 1, 2])
def test_native_snapshot_equals_env_copy(tw_games, game_index, fork_at):
    """The in-place snapshot relies on private TextWorld attributes; env.copy() is the engine's own fork."""
    game = str(tw_games[game_index])
    walkthrough = game_walkthrough(game)
    probe = TextWorldSandbox()
    probe.reset({"game": game})
    for action in walkthrough[:fork_at]:
        last = probe.step(action)
    admissible = probe.reset({"game": game}).info["admissible_commands"] if fork_at == 0 else last.info[
        "admissible_commands"
    ]
    probe.close()
    # every admissible command at the fork point, then the rest of the walkthrough (several steps per branch)
    branches = [[command, *walkthrough[fork_at:]] for command in admissible[:6]] + [walkthrough[fork_at:]]
    native = _fork_transcripts(game, walkthrough[:fork_at], branches, "native")
    copied = _fork_transcripts(game, walkthrough[:fork_at], branches, "copy")
    assert native == copied
    assert len({t[0][0] for t in native[:-1]}) > 1, "branches should differ at the fork"


@pytest.mark.parametrize("game_index", [0, 1])
def test_walkthrough_wins_with_total_reward_one(tw_games, game_index):
    game = str(tw_games[game_index])
    with TextWorldSandbox() as sandbox:
        obs = sandbox.reset({"game": game})
        assert "Admissible commands:" in obs.text and ">" not in obs.text.splitlines()[-1]
        results = [sandbox.step(a) for a in game_walkthrough(game)]
    assert [r.done for r in results] == [False] * (len(results) - 1) + [True]
    assert results[-1].info["won"] and not results[-1].info["lost"]
    assert sum(r.reward for r in results) == pytest.approx(1.0)
    assert not any(r.info["invalid_action"] for r in results)


def test_unknown_command_is_flagged_and_max_steps_truncates(tw_games):
    with TextWorldSandbox(TextWorldSandbox.Config(max_steps=2)) as sandbox:
        sandbox.reset({"game": str(tw_games[0])})
        first = sandbox.step("dance wildly")
        assert first.info["invalid_action"] and not first.done and first.reward == 0.0
        second = sandbox.step("look")
        assert not second.info["invalid_action"]
        assert second.done and second.info["truncated"] and not second.info["won"]
    with TextWorldSandbox(TextWorldSandbox.Config(max_steps=2)) as sandbox:
        sandbox.reset({"game": str(tw_games[0])})
        assert not sandbox.step("").done  # a turn without a command counts as a step too
        last = sandbox.step("no command\nhere")
        assert last.done and last.info["truncated"] and last.info["invalid_action"] and last.reward == 0.0


def test_no_command_writes_or_reads_a_file(tw_games, tmp_path, monkeypatch):
    """Byte 0x0e in a command is the interpreter's record hot key: it wrote the following commands into a file named
    by the command, in the engine's working directory (found in a learning run, in the repository's root); "save"
    writes the position there (and "restore" would load it into another episode), "script" a transcript."""
    monkeypatch.chdir(tmp_path)
    with TextWorldSandbox() as sandbox:
        sandbox.reset({"game": str(tw_games[0])})
        for command in ["go south\x0e coin", "look", "save", "Transcript", "script on", "restore", "inventory"]:
            result = sandbox.step(command)
            assert result.info["invalid_action"] == (command not in ("look", "inventory"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_games_are_reproducible_and_task_ids_resolve(tw_games, tmp_path):
    again = make_games(tmp_path, SEEDS[:1])
    assert again[0].read_bytes() == tw_games[0].read_bytes()
    # a second call finds the cached game instead of compiling it again
    mtime = again[0].stat().st_mtime_ns
    assert make_games(tmp_path, SEEDS[:1])[0].stat().st_mtime_ns == mtime
    games_dir = str(tw_games[0].parent)
    sandbox = make_sandbox("textworld", {"games_dir": games_dir})
    try:
        by_id = sandbox.reset({"task_id": 1}).text
        by_name = sandbox.reset({"game": tw_games[1].name}).text
        assert by_id == by_name
        with pytest.raises(ValueError, match="out of range"):
            sandbox.reset({"task_id": 5})
    finally:
        sandbox.close()


def test_restore_across_games_and_into_a_sandbox_on_another_game(tw_games):
    first, second = (str(g) for g in tw_games)
    with TextWorldSandbox() as parent, TextWorldSandbox() as other:
        parent.reset({"game": first})
        parent.step(game_walkthrough(first)[0])
        snap = parent.snapshot()
        other.reset({"game": second})
        other.restore(snap)
        assert other.task == {"game": first}
        rest = game_walkthrough(first)[1:]
        assert transcript([other.step(a) for a in rest]) == transcript([parent.step(a) for a in rest])


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("go north", "go north"),
        ("Take Key.", "take key"),
        ("I should look around first.\naction: look", "look"),
        ("`open chest`", "open chest"),
        ("", None),
        ("first line\nsecond line", None),
        ("x" * 500, None),
        ("go south\x0e coin", "go south coin"),  # control characters are Z-machine hot keys: dropped
        ("\x0f", None),  # the replay hot key alone: no command
    ],
)
def test_parse_action(text, action):
    assert TextWorldSandbox().parse_action(text) == action


def test_registry_and_config():
    assert get_sandbox_cls("textworld") is TextWorldSandbox
    assert TextWorldSandbox().snapshot_kind is SnapshotKind.NATIVE
    assert TextWorldSandbox(TextWorldSandbox.Config(snapshot="replay")).snapshot_kind is SnapshotKind.REPLAY
    with pytest.raises(ValueError, match="snapshot"):
        TextWorldSandbox.Config(snapshot="magic")


def test_a_relative_games_dir_is_where_the_sandbox_is_made(tmp_path, monkeypatch):
    """The engine process a sandbox is shipped to runs in a private directory: a relative ``games_dir`` must be
    resolved where the config is made."""
    monkeypatch.chdir(tmp_path)
    assert TextWorldSandbox.Config(games_dir="games").games_dir == str(tmp_path / "games")


def test_forks_into_fresh_sandboxes_neither_load_nor_reset_the_game(tw_games, monkeypatch):
    """The sampler restores each child into a fresh sandbox: it rebuilds the wrapper stack from the snapshot around
    a Z-machine of the pool (or a new one) instead of loading the game's .json and resetting."""
    import textworld.envs.zmachine.jericho as tw_jericho
    from textworld.generator.game import Game

    from sandbox_adapters import textworld as tw_adapter

    first, second = (str(g) for g in tw_games)
    walkthrough = game_walkthrough(first)
    with TextWorldSandbox() as parent:
        parent.reset({"game": first})
        parent.step(walkthrough[0])
        snap = parent.snapshot()
        expected = transcript([parent.step(a) for a in walkthrough[1:]])
    with TextWorldSandbox() as other:  # leaves an idle Z-machine set up for the other story
        other.reset({"game": second})
    loads, resets = [], []
    load, reset = Game.load, tw_jericho.JerichoEnv.reset
    monkeypatch.setattr(Game, "load", staticmethod(lambda *a, **kw: (loads.append(1), load(*a, **kw))[1]))
    monkeypatch.setattr(tw_jericho.JerichoEnv, "reset", lambda self: (resets.append(1), reset(self))[1])
    for idle in ({first: []}, {second: list(tw_adapter._IDLE_VMS.get(second, []))[:1]}, {}):
        monkeypatch.setattr(tw_adapter, "_IDLE_VMS", idle)  # none of this story / another story's / none at all
        child = TextWorldSandbox()
        child.restore(snap)
        assert transcript([child.step(a) for a in walkthrough[1:]]) == expected
        child.close()
    assert not loads and not resets
    assert expected[-1][1] > 0 and expected[-1][2]


def test_closed_sandboxes_recycle_their_z_machine_unless_a_call_still_runs(tw_games, monkeypatch):
    import threading

    from sandbox_adapters import textworld as tw_adapter

    monkeypatch.setattr(tw_adapter, "_IDLE_VMS", {})
    game = str(tw_games[0])
    with TextWorldSandbox() as sandbox:
        sandbox.reset({"game": game})
        vm = sandbox._jericho
    assert tw_adapter._IDLE_VMS[game] == [vm]
    with TextWorldSandbox() as again:
        again.reset({"game": game})
        assert again._jericho is vm  # the recycled machine, set up again for the story
        release, entered = threading.Event(), threading.Event()
        step = again._env.step

        def hanging(command):
            entered.set()
            release.wait()
            return step(command)

        again._env.step = hanging
        def play():
            with contextlib.suppress(Exception):  # the step ends on a closed sandbox
                again.step("look")

        worker = threading.Thread(target=play, daemon=True)
        worker.start()
        assert entered.wait(10)
        again.close()  # a quarantined sandbox is closed while its call still runs
        assert vm not in tw_adapter._IDLE_VMS[game]
        release.set()
        worker.join(10)


def test_make_games_names_an_unknown_challenge_or_setting(tmp_path):
    with pytest.raises(ValueError, match="challenge must be one of"):
        make_games(tmp_path, [0], challenge="tw-cooking")
    with pytest.raises(ValueError, match=r"unknown tw-coin_collector settings \['quest_length'\]"):
        make_games(tmp_path, [0], challenge="tw-coin_collector", quest_length=4)
    assert not list(tmp_path.iterdir())  # nothing is generated before the settings are checked
