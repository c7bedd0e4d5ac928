"""``SignpostSandbox``: a corridor whose outcome is decided at its end — routine moves first, one decisive choice last.

The agent starts in room 1 of a corridor of ``Config.length`` rooms and walks east. The last room holds a red and
a blue door and a sign naming the right one (``Config.right_door``: the task id decides, or one color for every
task): opening it wins (reward 1.0), opening the other loses (reward 0); either ends the episode, as does running
out of ``Config.max_steps`` turns. Walking is
routine; reading the sign is the one decision that matters, and it comes last. This is the late-decision
counterpart of the smoke corridor (:mod:`sandbox_adapters.smoke`), where the first moves decide.

Actions: ``east``, ``west``, ``open red door``, ``open blue door``, ``look`` (alone or as ``action: <action>``; a
reply that starts with an action and runs on still acts). A step takes microseconds and a snapshot is three small
values, so trees fork it freely.

Task specification: ``{"task_id": <int>}`` with ``0 <= task_id < Config.num_tasks``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any, ClassVar

from sandbox_adapters.base import (
    Observation,
    RestoreFailed,
    Sandbox,
    SandboxCrashed,
    Snapshot,
    SnapshotKind,
    StepResult,
    match_action,
)
from sandbox_adapters.registry import register_sandbox

__all__ = ["SignpostSandbox", "ACTIONS", "COLORS"]

COLORS = ("red", "blue")
ACTIONS: tuple[str, ...] = ("east", "west", "open red door", "open blue door", "look")


@register_sandbox("signpost")
class SignpostSandbox(Sandbox):
    """The signpost corridor; see the module docstring for the rules and the action vocabulary."""

    @dataclasses.dataclass
    class Config:
        """Keys accepted under ``bpo.sandbox.config`` for ``name=signpost``.

        Attributes:
            length: rooms in the corridor, the doors in the last (default 4; at least 2).
            num_tasks: how many task ids exist (default 128); task ``i`` has its own right door.
            max_steps: turns after which the episode ends unwon (default 8); turns without a valid action count.
            invalid_penalty: reward subtracted for a turn without a valid action (default 0.0).
            right_door: ``task`` (default): the task id draws the right door, so the sign must be read; ``red`` or
                ``blue``: that door for every task (the choice is still decided only at the end).
        """

        length: int = 4
        num_tasks: int = 128
        max_steps: int = 8
        invalid_penalty: float = 0.0
        right_door: str = "task"

        def __post_init__(self) -> None:
            if self.length < 2:
                raise ValueError(f"signpost: length must be >= 2, got {self.length}")
            if self.right_door not in ("task", *COLORS):
                raise ValueError(f"signpost: right_door must be 'task', 'red' or 'blue', got {self.right_door!r}")
            if self.num_tasks < 1 or self.max_steps < self.length:
                raise ValueError("signpost: num_tasks must be >= 1 and max_steps >= length (the walk must fit)")

    name: ClassVar[str] = "signpost"
    blocking: ClassVar[bool] = False  # microseconds per call, nothing to wait on
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.NATIVE

    def __init__(self, config: SignpostSandbox.Config | None = None) -> None:
        super().__init__()
        self.config = config or SignpostSandbox.Config()
        self._right = COLORS[0]
        self._room, self._steps = 0, 0

    def right_door(self, task: Mapping[str, Any]) -> str:
        task_id = int(task["task_id"])
        if not 0 <= task_id < self.config.num_tasks:
            raise ValueError(f"signpost: task_id must be in [0, {self.config.num_tasks}), got {task_id}")
        if self.config.right_door != "task":
            return self.config.right_door
        return random.Random(7919 * task_id + self.config.length).choice(COLORS)

    def best_action(self) -> str:
        """What an agent that reads the sign does."""
        return "east" if self._room < self.config.length - 1 else f"open {self._right} door"

    def demonstration(self, rng: random.Random) -> str:
        """What the warm start imitates: a walker that never reads the sign (it picks a door at random)."""
        return "east" if self._room < self.config.length - 1 else f"open {rng.choice(COLORS)} door"

    # --- engine hooks ---------------------------------------------------------------------------------------
    def _reset(self, task: Mapping[str, Any]) -> Observation:
        self._right = self.right_door(task)
        self._room, self._steps = 0, 0
        intro = (f"You are in a corridor of {self.config.length} rooms. At its east end are a red door and a blue "
                 "door; a sign there tells which one leads out. Open the right door.")
        return Observation(f"{intro}\n{self._describe()}", self._info())

    def parse_action(self, text: str) -> str | None:
        return match_action(text, ACTIONS)

    def _step_text(self, action_text: str) -> StepResult:
        result = super()._step_text(action_text)
        if not result.info.get("invalid_action"):
            return result
        self._steps += 1
        return self._end_at_step_limit(dataclasses.replace(result, reward=-self.config.invalid_penalty),
                                       self._steps, self.config.max_steps)

    def _apply(self, action: str) -> StepResult:
        try:
            return self._transition(action)
        except Exception as exc:  # a bug in the engine must end one leaf, not the tree
            raise SandboxCrashed(f"signpost: step {action!r} failed: {exc!r}") from exc

    def _transition(self, action: str) -> StepResult:
        self._steps += 1
        last = self.config.length - 1
        if action.startswith("open "):
            if self._room != last:
                return self._continue("There is no door here.")
            won = action == f"open {self._right} door"
            text = "The door opens onto daylight. You won!" if won else "The door opens onto a wall. You lost."
            info = {**self._info(), "won": won}
            return StepResult(Observation(text, info), 1.0 if won else 0.0, True, info)
        if action == "east":
            moved = self._room < last
            self._room += moved
            return self._continue("You walk east." if moved else "A wall blocks the way.")
        if action == "west":
            moved = self._room > 0
            self._room -= moved
            return self._continue("You walk west." if moved else "A wall blocks the way.")
        return self._continue("You look around.")

    def _continue(self, message: str) -> StepResult:
        info = {**self._info(), "won": False}
        result = StepResult(Observation(f"{message}\n{self._describe()}", info), 0.0, False, info)
        return self._end_at_step_limit(result, self._steps, self.config.max_steps)

    def _describe(self) -> str:
        if self._room == self.config.length - 1:
            return f"Room {self._room + 1}, the last. The sign says: {self._right}. Exits: west."
        exits = "east, west" if self._room > 0 else "east"
        return f"Room {self._room + 1}. The corridor goes on. Exits: {exits}."

    def _info(self) -> dict[str, Any]:
        return {"admissible_commands": list(ACTIONS), "steps": self._steps}

    # --- native snapshot ------------------------------------------------------------------------------------
    def _snapshot_payload(self) -> Any:
        return self._right, self._room, self._steps

    def _restore_payload(self, snapshot: Snapshot) -> None:
        payload = snapshot.payload
        if not (isinstance(payload, tuple) and len(payload) == 3 and payload[0] in COLORS):
            raise RestoreFailed(f"signpost: snapshot payload is not a signpost state: {type(payload).__name__}")
        self._right, self._room, self._steps = payload

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return ("You are an agent in a text game. Each turn, reply with exactly one action from: "
                f"{', '.join(ACTIONS)}. Write it alone or as 'action: <action>'.")

    def invalid_action_text(self, text: str) -> str:
        return f"Invalid action. Reply with one of: {', '.join(ACTIONS)}."
