"""Conformance and rule tests of the signpost corridor (the late-decision task, and its early-decision variant)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from sandbox_adapters.base import RestoreFailed
from sandbox_adapters.registry import make_sandbox
from sandbox_adapters.signpost import COLORS, PALETTE, SignpostSandbox
from tests.sandboxes.conformance import SandboxConformance


class TestSignpostConformance(SandboxConformance):
    many_restores = 20

    def make_sandbox(self) -> SignpostSandbox:
        return SignpostSandbox()

    def task(self):
        return {"task_id": 0}

    def prefix_actions(self):
        return ["east"]

    def probe_actions(self):
        return ["east", "action: east", "look", "open red door"]

    def other_action(self):
        return "west"

    def inject_step_crash(self, sandbox):
        def broken(action):
            raise ZeroDivisionError("engine bug")

        sandbox._transition = broken


def test_only_the_last_choice_decides_and_the_sign_names_it():
    box = make_sandbox("signpost", {"length": 4})
    rights = set()
    for task_id in range(16):
        obs = box.reset({"task_id": task_id})
        for _ in range(3):
            obs = box.step("east").observation
        right = box.right_door({"task_id": task_id})
        rights.add(right)
        assert f"The sign says: {right}." in obs.text
        wrong = next(c for c in COLORS if c != right)
        snap = box.snapshot()
        won = box.step(f"open {right} door")
        box.restore(snap)
        lost = box.step(f"open {wrong} door")
        assert (won.reward, won.done, won.info["won"]) == (1.0, True, True)
        assert (lost.reward, lost.done, lost.info["won"]) == (0.0, True, False)
    assert rights == set(COLORS)  # the task draws the door


def test_doors_elsewhere_waste_a_turn_and_the_step_limit_ends_the_walk():
    box = SignpostSandbox(SignpostSandbox.Config(length=3, max_steps=4, right_door="blue", invalid_penalty=0.1))
    box.reset({"task_id": 5})
    assert not box.step("open blue door").done  # no door in room 1
    assert box.step("dance").reward == -0.1  # no action: a penalised turn
    box.step("east")
    final = box.step("look")
    assert final.done and not final.info["won"]  # four turns, never at the doors


def test_the_demonstrator_walks_and_picks_doors_at_random():
    box = SignpostSandbox(SignpostSandbox.Config(length=3))
    rng = random.Random(0)
    choices = set()
    for _ in range(20):
        box.reset({"task_id": 1})
        assert box.demonstration(rng) == "east"
        box.step("east")
        box.step("east")
        choices.add(box.demonstration(rng))
    assert choices == {"open red door", "open blue door"}


class TestSignpostStartConformance(TestSignpostConformance):
    """The early-decision variant: the doors first, the walk after."""

    def make_sandbox(self) -> SignpostSandbox:
        return SignpostSandbox(SignpostSandbox.Config(decide_at="start"))

    def prefix_actions(self):
        return ["open red door"]

    def probe_actions(self):
        return ["east", "action: east", "look", "west"]


def test_at_the_start_the_first_choice_decides_and_the_walk_reveals_it():
    box = SignpostSandbox(SignpostSandbox.Config(length=4, decide_at="start"))
    for task_id in range(8):
        obs = box.reset({"task_id": task_id})
        right = box.right_door({"task_id": task_id})
        assert f"The sign says: {right}." in obs.text
        assert box.step("east").observation.text.startswith("The doors are closed")  # a wasted turn
        snap = box.snapshot()
        for door, won in ((right, True), (next(c for c in COLORS if c != right), False)):
            box.restore(snap)
            assert not box.step(f"open {door} door").done
            assert not box.step("open red door").done  # no more doors behind it
            steps = [box.step("east") for _ in range(3)]
            assert [s.done for s in steps] == [False, False, True]  # the end of the corridor ends the episode
            assert (steps[-1].reward, steps[-1].info["won"]) == (float(won), won)


def test_at_the_start_the_demonstrator_picks_a_door_then_walks():
    box = SignpostSandbox(SignpostSandbox.Config(length=3, decide_at="start"))
    rng = random.Random(0)
    choices = set()
    for _ in range(20):
        box.reset({"task_id": 1})
        choices.add(box.demonstration(rng))
        box.step("open blue door")
        assert box.demonstration(rng) == "east" and box.best_action() == "east"
    assert choices == {"open red door", "open blue door"}


# --- more doors (``Config.doors``): the hard tasks' eight-door corridor ----------------------------------------------


def test_more_doors_each_task_draws_one_the_sign_names_it_and_only_it_wins():
    box = make_sandbox("signpost", {"length": 3, "doors": 8, "num_tasks": 64})
    colors = PALETTE[:8]
    assert box.colors == colors and len(set(colors)) == 8 and all(" " not in c for c in colors)
    rights = set()
    for task_id in range(64):
        first = box.reset({"task_id": task_id})
        assert all(f"a {c} door" in first.text for c in colors)  # the intro lists every door
        assert first.info["admissible_commands"] == ["east", "west", *(f"open {c} door" for c in colors), "look"]
        obs = box.step("east").observation
        obs = box.step("east").observation
        right = box.right_door({"task_id": task_id})
        rights.add(right)
        assert f"The sign says: {right}." in obs.text
        snap = box.snapshot()
        for color in colors:
            box.restore(snap)
            result = box.step(f"open {color} door")
            won = color == right
            assert (result.reward, result.done, result.info["won"]) == (float(won), True, won)
    assert rights == set(colors)  # every door is the right one for some task


def test_more_doors_the_vocabulary_prompt_and_parser_follow_the_door_count():
    box = SignpostSandbox(SignpostSandbox.Config(doors=4))
    assert box.parse_action("action: open yellow door") == "open yellow door"
    assert box.parse_action("open green door please") == "open green door"
    assert box.parse_action("open purple door") is None  # the fifth to eighth colors are not doors here
    assert "open yellow door" in box.system_prompt() and "purple" not in box.system_prompt()
    box.reset({"task_id": 0})
    assert box.step("open purple door").info["invalid_action"]
    assert "open green door" in box.invalid_action_text("x")
    assert SignpostSandbox().parse_action("open green door") is None  # two doors by default


def test_more_doors_at_the_start_the_first_choice_decides():
    box = SignpostSandbox(SignpostSandbox.Config(length=3, doors=7, decide_at="start", right_door="orange"))
    obs = box.reset({"task_id": 3})
    assert "The sign says: orange." in obs.text and "a black door" in obs.text
    snap = box.snapshot()
    for door in box.colors:
        box.restore(snap)
        assert not box.step(f"open {door} door").done
        steps = [box.step("east") for _ in range(2)]
        assert [s.done for s in steps] == [False, True]
        assert steps[-1].reward == float(door == "orange")
    rng = random.Random(0)
    choices = set()
    for _ in range(200):
        box.reset({"task_id": 3})
        choices.add(box.demonstration(rng))
    assert choices == {f"open {c} door" for c in box.colors}  # the demonstrator picks any door at random


def test_more_doors_snapshot_round_trip_and_foreign_payloads_refused():
    box = SignpostSandbox(SignpostSandbox.Config(length=4, doors=8, right_door="purple", decide_at="start"))
    box.reset({"task_id": 0})
    box.step("open purple door")
    snap = box.snapshot()
    assert snap.payload[0] == "purple" and snap.payload[3] == "purple"
    rest = [box.step("east").observation.text for _ in range(3)]
    other = SignpostSandbox(SignpostSandbox.Config(length=4, doors=8, right_door="purple", decide_at="start"))
    other.reset({"task_id": 0})
    other.restore(snap)
    replay = [other.step("east") for _ in range(3)]
    assert [r.observation.text for r in replay] == rest and replay[-1].reward == 1.0
    for payload in (("pink", 0, 0, None), ("purple", 0, 0, "pink"), ("purple", 0, 0)):
        with pytest.raises(RestoreFailed):
            other.restore(dataclasses.replace(snap, payload=payload))
    two = SignpostSandbox()  # a two-door corridor has no purple door
    two.reset({"task_id": 0})
    with pytest.raises(RestoreFailed):
        two.restore(snap)


def test_invalid_door_counts_and_right_doors_are_refused():
    for doors in (0, 1, 17, 2.5, True):
        with pytest.raises(ValueError, match="doors must be an int from 2 to 16"):
            SignpostSandbox.Config(doors=doors)
    with pytest.raises(ValueError, match="right_door must be 'task' or one of the doors' colors"):
        SignpostSandbox.Config(doors=3, right_door="yellow")  # yellow is the fourth door
    assert SignpostSandbox.Config(doors=4, right_door="yellow").colors == ("red", "blue", "green", "yellow")


def test_a_reply_that_runs_on_still_acts_and_is_not_charged():
    box = SignpostSandbox(SignpostSandbox.Config(length=3, right_door="red"))
    box.reset({"task_id": 0})
    first = box.step("east east east")  # a turn cut at its token limit
    assert first.reward == 0.0 and not first.info.get("invalid_action") and "Room 2." in first.observation.text
    box.step("east")
    won = box.step("open red door open red")
    assert won.done and won.info["won"] and won.reward == 1.0
