"""Conformance and rule tests of the signpost corridor (the late-decision task, and its early-decision variant)."""

from __future__ import annotations

import random

from sandbox_adapters.registry import make_sandbox
from sandbox_adapters.signpost import COLORS, SignpostSandbox
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
