"""Conformance and rule tests of the pure-Python smoke corridor."""

from __future__ import annotations

import pytest

from sandbox_adapters.base import SandboxCrashed, SnapshotKind
from sandbox_adapters.registry import get_sandbox_cls, make_sandbox
from sandbox_adapters.smoke import ACTIONS, SmokeSandbox
from tests.sandboxes.conformance import SandboxConformance, transcript


class TestSmokeConformance(SandboxConformance):
    many_restores = 20

    def make_sandbox(self) -> SmokeSandbox:
        return SmokeSandbox()

    def task(self):
        return {"task_id": 0}  # start room 1, key in room 2, door in room 4

    def prefix_actions(self):
        return ["east"]

    def probe_actions(self):
        return ["action: take key", "east", "east", "open door"]

    def other_action(self):
        return "west"

    def inject_step_crash(self, sandbox):
        def broken(action):
            raise ZeroDivisionError("engine bug")

        sandbox._transition = broken


class TestSlipperySmokeConformance(TestSmokeConformance):
    """The stochastic variant: replay checks are skipped, same-seed restores must still agree."""

    def make_sandbox(self) -> SmokeSandbox:
        return SmokeSandbox(SmokeSandbox.Config(slip_prob=0.5, max_steps=40))

    def probe_actions(self):
        return ["east", "west", "east", "west", "east", "west", "east", "east"]


def test_every_task_is_won_by_its_solution_and_answers_differ():
    sandbox = SmokeSandbox()
    solutions = set()
    for task_id in range(sandbox.config.num_tasks):
        sandbox.reset({"task_id": task_id})
        plan = sandbox.solution({"task_id": task_id})
        solutions.add(tuple(plan))
        results = [sandbox.step(a) for a in plan]
        assert [r.done for r in results] == [False] * (len(plan) - 1) + [True]
        assert results[-1].reward == 1.0 and results[-1].info["won"]
        assert sum(r.reward for r in results) == 1.0
    assert len(solutions) >= 5


def test_wrong_order_is_not_rewarded_and_max_steps_ends_episode():
    sandbox = SmokeSandbox(SmokeSandbox.Config(max_steps=3))
    sandbox.reset({"task_id": 0})
    assert sandbox.step("open door").observation.text.startswith("There is no door here.")
    result = sandbox.step("look")
    assert (result.reward, result.done) == (0.0, False)
    result = sandbox.step("look")
    assert (result.reward, result.done) == (0.0, True)
    assert not result.info["won"]
    assert "ran out of steps" in result.observation.text
    with pytest.raises(RuntimeError):
        sandbox.step("look")


def test_turns_without_an_action_count_towards_max_steps():
    sandbox = SmokeSandbox(SmokeSandbox.Config(max_steps=2))
    sandbox.reset({"task_id": 0})
    first = sandbox.step("fly")
    assert first.info["invalid_action"] and not first.done
    second = sandbox.step("dance")
    assert second.done and second.reward == 0.0 and not second.info["won"]
    assert "ran out of steps" in second.observation.text


def test_door_needs_the_key():
    sandbox = SmokeSandbox()
    sandbox.reset({"task_id": 2})  # key and start in room 2, door in room 4
    for action in ("east", "east"):
        sandbox.step(action)
    result = sandbox.step("open door")
    assert (result.reward, result.done) == (0.0, False)
    assert "locked" in result.observation.text


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("east", "east"),
        ("  East. ", "east"),
        ("go west", "west"),
        ("I think the key is here.\naction: take key", "take key"),
        ("Action: open the door", "open door"),
        ("action: east\naction: west", "west"),
        ("take key key key key", "take key"),
        ("look around", "look"),
        ("eastward", None),
        ("fly", None),
        ("action: dance", None),
        ("", None),
    ],
)
def test_parse_action(text, action):
    assert SmokeSandbox().parse_action(text) == action


def test_unknown_task_and_bad_config_are_rejected():
    with pytest.raises(ValueError, match="task_id"):
        SmokeSandbox().reset({"task_id": 99})
    with pytest.raises(ValueError, match="slip_prob"):
        SmokeSandbox.Config(slip_prob=1.5)


def test_reseed_changes_slips_and_snapshot_keeps_rng():
    config = SmokeSandbox.Config(slip_prob=0.5, max_steps=100)
    parent = SmokeSandbox(config)
    parent.reset({"task_id": 0})
    snap = parent.snapshot()
    moves = ["east", "west"] * 10
    runs = {}
    for seed in (1, 2):
        child = SmokeSandbox(config)
        child.restore(snap, seed=seed)
        runs[seed] = transcript([child.step(a) for a in moves])
    assert runs[1] != runs[2]
    # restore without a seed continues the parent's own random stream
    unseeded = SmokeSandbox(config)
    unseeded.restore(snap)
    assert transcript([unseeded.step(a) for a in moves]) == transcript([parent.step(a) for a in moves])


def test_registry_and_config_keys():
    assert get_sandbox_cls("smoke") is SmokeSandbox
    sandbox = make_sandbox("smoke", {"length": 6, "max_steps": 20})
    assert isinstance(sandbox, SmokeSandbox) and sandbox.config.length == 6
    assert sandbox.snapshot_kind is SnapshotKind.NATIVE
    assert set(sandbox.reset({"task_id": 1}).info["admissible_commands"]) == set(ACTIONS)


def test_crash_is_typed():
    sandbox = SmokeSandbox()
    sandbox.reset({"task_id": 0})
    sandbox._layout = None  # corrupt engine state: the transition raises a TypeError inside
    with pytest.raises(SandboxCrashed):
        sandbox.step("take key")


def test_key_reward_shapes_the_key_pickup_only():
    from sandbox_adapters.smoke import SmokeSandbox

    box = SmokeSandbox(SmokeSandbox.Config(key_reward=0.25))
    task = {"task_id": 2}
    box.reset(task)
    rewards = [box.step(a).reward for a in box.solution(task)]
    assert rewards[-1] == 1.0 and 0.25 in rewards and sum(rewards) == 1.25


def test_invalid_penalty_charges_turns_without_an_action_only():
    box = SmokeSandbox(SmokeSandbox.Config(invalid_penalty=0.1, max_steps=3))
    box.reset({"task_id": 2})
    assert box.step("look").reward == 0.0
    assert box.step("dance wildly").reward == pytest.approx(-0.1)
    last = box.step("fly east")  # the third turn: invalid, and the step limit ends the episode
    assert last.done and last.reward == pytest.approx(-0.1) and not last.info["won"]


@pytest.mark.parametrize("task_id", range(8))
def test_best_action_wins_from_any_state(task_id):
    box = SmokeSandbox(SmokeSandbox.Config(length=4, max_steps=30))
    task = {"task_id": task_id}
    box.reset(task)
    for action in ("west", "east", "east", "take key", "west"):  # wander first (possibly taking the key)
        box.step(action)
    for _ in range(10):
        result = box.step(box.best_action())
        if result.done:
            break
    assert result.info["won"]
