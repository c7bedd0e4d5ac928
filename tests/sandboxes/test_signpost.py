"""Conformance and rule tests of the signpost corridor (the late-decision task)."""

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
