"""The real-engine tasks (``verl_bpo.demo.textworld_tasks``): their demonstrator, their games and their sandbox."""

from __future__ import annotations

import dataclasses
import random

import pytest

pytest.importorskip("textworld", reason="textworld is not installed (pip install -e .[envs])")
pytest.importorskip("jericho", reason="jericho is not installed (pip install -e .[envs])")

from sandbox_adapters.registry import make_sandbox  # noqa: E402
from sandbox_adapters.textworld import CHALLENGES, TextWorldSandbox, game_walkthrough, make_games  # noqa: E402
from verl_bpo.demo import textworld_tasks as tw  # noqa: E402

pytestmark = pytest.mark.envs
# `slow` (outside the fast tier): the tests on built games (a tw-make run per game).

WALKTHROUGH = ["go west", "open chest", "take key from chest", "go east", "unlock door with key", "open door",
               "go north", "close door"]
ADMISSIBLE = sorted({*WALKTHROUGH, "look", "inventory", "examine chest", "drop lamp", "go south"})


def test_tasks_differ_only_in_where_the_decision_sits():
    late, early = tw.real_late, tw.real_early
    assert late.name.endswith("_late") and early.name.endswith("_early")
    assert dataclasses.replace(early, name=late.name, warm_start=late.warm_start) == late
    assert (late.warm_start["decisive"], early.warm_start["decisive"]) == ("last", "first")
    # evaluation plays the training games (sampled episodes of its own): the warm start knows their routes only
    assert late.eval_ids == late.train_ids and late.max_turns == late.sandbox_config["max_steps"] >= 8
    assert tw.QUEST_LENGTH >= 3 and tw.CHALLENGE in CHALLENGES
    # the late form whose decision differs between games: real_late on fewer games, deciding the seventh room's move
    exit_ = tw.real_late_exit
    assert "late" in exit_.name.split("_") and exit_.eval_ids == exit_.train_ids == range(tw.N_EXIT_GAMES)
    assert dataclasses.replace(exit_, name=late.name, warm_start=late.warm_start, train_ids=late.train_ids,
                               eval_ids=late.eval_ids) == late
    assert exit_.warm_start["decisive"] == "next_to_last"


@pytest.mark.parametrize(("decisive", "index"),
                         [("last", len(WALKTHROUGH) - 1), ("next_to_last", len(WALKTHROUGH) - 2), ("first", 0)])
def test_demonstrator_follows_the_walkthrough_except_at_the_decisive_step(decisive, index):
    assert tw.decisive_step(len(WALKTHROUGH), decisive) == index
    picks = {turn: set() for turn in range(len(WALKTHROUGH))}
    for seed in range(64):
        rng = random.Random(seed)
        for turn in range(len(WALKTHROUGH)):
            picks[turn].add(tw.demonstrator_action(turn, turn, WALKTHROUGH, ADMISSIBLE, rng, index, noise=0.0))
    for turn, actions in picks.items():
        if turn == index:  # uniform among the admissible commands: many different ones over 64 draws
            assert actions <= set(ADMISSIBLE) and len(actions) >= 6
        else:
            assert actions == {WALKTHROUGH[turn]}


def test_demonstrator_noise_and_a_walkthrough_command_no_longer_admissible():
    rng = random.Random(0)
    noisy = [tw.demonstrator_action(1, 1, WALKTHROUGH, ADMISSIBLE, rng, 7, noise=0.5) for _ in range(200)]
    assert 0.3 < sum(a != WALKTHROUGH[1] for a in noisy) / 200 < 0.7
    # after a deviation the walkthrough's command may not be admissible: a random admissible one instead
    assert tw.demonstrator_action(1, 1, WALKTHROUGH, ["look", "go south"], rng, 7, noise=0.0) in {"look", "go south"}
    # a wrong guess that did not move ("look" at the decisive first turn): the walkthrough's first command next
    assert tw.demonstrator_action(1, 0, WALKTHROUGH, ADMISSIBLE, rng, 0, noise=0.0) == WALKTHROUGH[0]
    with pytest.raises(ValueError):
        tw.decisive_step(8, "middle")
    # a one-command walkthrough has a first and a last step, and no next-to-last one
    assert tw.decisive_step(1, "last") == tw.decisive_step(1, "first") == 0
    with pytest.raises(ValueError, match="no next_to_last step"):
        tw.decisive_step(1, "next_to_last")


@pytest.fixture(scope="module")
def built(tmp_path_factory, monkeypatch_module):
    """``build_games`` for two games (one chunk of two seeds)."""
    monkeypatch_module.setattr(tw, "N_TRAIN", 2)
    monkeypatch_module.setattr(tw, "SEED_CHUNK", 2)
    out = tmp_path_factory.mktemp("tw_real")
    return out, tw.build_games(out)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.slow
def test_game_generation_is_deterministic_and_cached(built, tmp_path, monkeypatch):
    out, games = built
    chosen = sorted(games.glob("*.z8"))
    assert len(chosen) == 2 and all(len(game_walkthrough(g)) == tw.QUEST_LENGTH for g in chosen)
    assert games == tw.games_dir(out)
    # the same seed in another directory gives byte-identical files
    again = make_games(tmp_path, [int(chosen[0].stem.rsplit("_s", 1)[1])], challenge=tw.CHALLENGE,
                       **tw.GAME_SETTINGS)[0]
    assert again.read_bytes() == chosen[0].read_bytes()
    assert again.with_suffix(".json").read_bytes() == chosen[0].with_suffix(".json").read_bytes()

    # cached: building again generates nothing
    def no_generation(*args, **kwargs):
        raise AssertionError("build_games regenerated cached games")

    monkeypatch.setattr(tw, "make_games", no_generation)
    assert tw.build_games(out) == games


@pytest.mark.slow
def test_task_sandbox_resets_steps_and_wins_along_the_walkthrough(built):
    out, games = built
    task = tw.with_games(tw.real_late, out)
    assert task.sandbox_config["games_dir"] == str(games.resolve())
    box = make_sandbox(task.sandbox, task.sandbox_config)
    try:
        obs = box.reset({"task_id": 0})
        assert obs.text.lstrip()[0].isalpha() and "$$" not in obs.text  # the ASCII-art title is stripped
        assert "Admissible commands:" in obs.text
        walkthrough = game_walkthrough(box.resolve_game({"task_id": 0}))
        for turn, action in enumerate(walkthrough):
            result = box.step(action)
            assert result.done == (turn == len(walkthrough) - 1)
        assert result.info["won"] and result.reward > 0
        # the step budget leaves max_steps - len(walkthrough) turns of slack: one wasted turn more costs the game
        slack = task.sandbox_config["max_steps"] - len(walkthrough)
        assert slack >= 0
        for wasted in (slack, slack + 1):
            box.reset({"task_id": 0})
            for action in ["look"] * wasted + walkthrough:
                result = box.step(action)
                if result.done:
                    break
            assert result.done and result.info["won"] == (wasted == slack)
    finally:
        box.close()
    with TextWorldSandbox(TextWorldSandbox.Config(games_dir=str(games))) as plain:  # default: the title stays
        assert "$$" in plain.reset({"task_id": 0}).text


@pytest.mark.slow
def test_demonstration_chats_follow_the_walkthrough(built):
    out, _ = built
    for task in tw.TEXTWORLD_TASKS.values():
        task = tw.with_games(dataclasses.replace(task, train_ids=range(1),
                                                 warm_start={**task.warm_start, "noise": 0.0}), out)
        walkthrough = game_walkthrough(make_sandbox("textworld", task.sandbox_config).resolve_game({"task_id": 0}))
        index = tw.decisive_step(len(walkthrough), task.warm_start["decisive"])
        for chat in tw.demonstration_chats(task, episodes=4):
            actions = [m["content"] for m in chat if m["role"] == "assistant"]
            assert len(actions) <= task.max_turns  # slack turns after a wrong guess, up to the budget
            if index > 0:  # the walkthrough up to the guess; after a late guess no slack is left to recover
                assert actions[:index] == walkthrough[:index]
                if actions[index] == walkthrough[index]:  # a right guess: the walkthrough to its end
                    assert actions == walkthrough
            elif actions[0] == walkthrough[0]:  # after the guess, the walkthrough wherever it is still admissible
                assert actions == walkthrough
            else:  # a wrong guess in the first room does not move (its one exit is the walkthrough's first command)
                assert actions[1:] == walkthrough[: len(actions) - 1]
