"""``SignpostSandbox``: a corridor with one decisive choice of door — at its end (routine moves first), or at its
start (routine moves after).

``Config.decide_at="end"`` (default): the agent starts in room 1 of a corridor of ``Config.length`` rooms and walks
east. The last room holds ``Config.doors`` doors (default 2: a red and a blue one; more take the next colors of
:data:`PALETTE`: green, yellow, white, black, orange, purple and eight more) and a sign naming the right one
(``Config.right_door``: the task id draws it among the doors, or one color for every task): opening it wins (reward
1.0), opening another loses (reward 0); either ends the episode, as does running out of ``Config.max_steps`` turns.
Walking is routine; reading the sign is the one decision that matters, and it comes last.

``decide_at="start"``: the doors and the sign are in room 1, and each door opens onto its own corridor. The agent
opens one, then walks east; reaching the corridor's last room ends the episode, won behind the right door (reward
1.0) and lost behind any other (a wall, reward 0). The same choice and the same walk, in the other order: the first
move decides, and the outcome shows only at the end.

Actions: ``east``, ``west``, ``open <color> door`` for each door (``open red door``, ``open blue door`` with the
default two: :data:`ACTIONS`; :func:`door_actions` for any count), ``look`` (alone or as ``action: <action>``; a
reply that starts with an action and runs on still acts). A step takes
microseconds and a snapshot is four small values, so trees fork it freely.

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

__all__ = ["SignpostSandbox", "ACTIONS", "COLORS", "PALETTE", "door_actions"]

# The door colors, in the order doors take them: distinct single words (each one token for the demo's tokenizer).
PALETTE: tuple[str, ...] = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple",
                           "pink", "brown", "gray", "gold", "silver", "cyan", "teal", "violet")
COLORS = PALETTE[:2]  # the doors of the default config


def door_actions(colors: tuple[str, ...]) -> tuple[str, ...]:
    """The action vocabulary with a door of each of ``colors``."""
    return ("east", "west", *(f"open {c} door" for c in colors), "look")


ACTIONS: tuple[str, ...] = door_actions(COLORS)  # with the default two doors


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
            doors: how many doors (default 2: red and blue); they take the first ``doors`` colors of
                :data:`PALETTE` (2 to 16).
            right_door: ``task`` (default): the task id draws the right door among the doors, so the sign must be
                read; a door's color (``red``, ``blue``, ...): that door for every task.
            decide_at: ``end`` (default): the doors are in the last room; ``start``: in the first, each opening onto
                its own corridor (module docstring).
        """

        length: int = 4
        num_tasks: int = 128
        max_steps: int = 8
        invalid_penalty: float = 0.0
        right_door: str = "task"
        decide_at: str = "end"
        doors: int = 2

        def __post_init__(self) -> None:
            if self.length < 2:
                raise ValueError(f"signpost: length must be >= 2, got {self.length}")
            if isinstance(self.doors, bool) or not isinstance(self.doors, int) or not 2 <= self.doors <= len(PALETTE):
                raise ValueError(f"signpost: doors must be an int from 2 to {len(PALETTE)} (colors "
                                 f"{', '.join(PALETTE)}), got {self.doors!r}")
            if self.right_door not in ("task", *self.colors):
                raise ValueError(f"signpost: right_door must be 'task' or one of the doors' colors "
                                 f"({', '.join(self.colors)}), got {self.right_door!r}")
            if self.decide_at not in ("end", "start"):
                raise ValueError(f"signpost: decide_at must be 'end' or 'start', got {self.decide_at!r}")
            if self.num_tasks < 1 or self.max_steps < self.length:
                raise ValueError("signpost: num_tasks must be >= 1 and max_steps >= length (the walk must fit)")

        @property
        def colors(self) -> tuple[str, ...]:
            """The doors' colors, in order."""
            return PALETTE[: self.doors]

    name: ClassVar[str] = "signpost"
    blocking: ClassVar[bool] = False  # microseconds per call, nothing to wait on
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.NATIVE

    def __init__(self, config: SignpostSandbox.Config | None = None) -> None:
        super().__init__()
        self.config = config or SignpostSandbox.Config()
        self.colors = self.config.colors
        self.vocabulary = door_actions(self.colors)
        self._right = self.colors[0]
        self._room, self._steps = 0, 0
        self._opened: str | None = None  # the door taken (``decide_at="start"``)

    def right_door(self, task: Mapping[str, Any]) -> str:
        task_id = int(task["task_id"])
        if not 0 <= task_id < self.config.num_tasks:
            raise ValueError(f"signpost: task_id must be in [0, {self.config.num_tasks}), got {task_id}")
        if self.config.right_door != "task":
            return self.config.right_door
        return random.Random(7919 * task_id + self.config.length).choice(self.colors)

    @property
    def _decides_first(self) -> bool:
        """Whether the doors come first (``decide_at="start"``)."""
        return self.config.decide_at == "start"

    def _at_doors(self) -> bool:
        if self._decides_first:
            return self._opened is None
        return self._room == self.config.length - 1

    def best_action(self) -> str:
        """What an agent that reads the sign does."""
        return f"open {self._right} door" if self._at_doors() else "east"

    def demonstration(self, rng: random.Random) -> str:
        """What the warm start imitates: a walker that never reads the sign (it picks a door at random)."""
        return f"open {rng.choice(self.colors)} door" if self._at_doors() else "east"

    # --- engine hooks ---------------------------------------------------------------------------------------
    def _reset(self, task: Mapping[str, Any]) -> Observation:
        self._right = self.right_door(task)
        self._room, self._steps, self._opened = 0, 0, None
        if self._decides_first:
            intro = (f"You stand before {self._door_list()}, each opening onto a corridor of "
                     f"{self.config.length} rooms; a sign tells which one leads out. Open the right door, then walk "
                     "east to the end of its corridor.")
        else:
            intro = (f"You are in a corridor of {self.config.length} rooms. At its east end are {self._door_list()}; "
                     "a sign there tells which one leads out. Open the right door.")
        return Observation(f"{intro}\n{self._describe()}", self._info())

    def parse_action(self, text: str) -> str | None:
        return match_action(text, self.vocabulary)

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
        start = self._decides_first
        if action.startswith("open "):
            if not self._at_doors():
                return self._continue("There is no door here.")
            if start:
                self._opened = action.split()[1]
                return self._continue(f"You open the {self._opened} door and step into its corridor.")
            return self._end(action == f"open {self._right} door")
        if start and self._opened is None:
            return self._continue("The doors are closed; open one.")
        if action == "east":
            moved = self._room < last
            self._room += moved
            if start and self._room == last:
                return self._end(self._opened == self._right)
            return self._continue("You walk east." if moved else "A wall blocks the way.")
        if action == "west":
            moved = self._room > 0
            self._room -= moved
            return self._continue("You walk west." if moved else "A wall blocks the way.")
        return self._continue("You look around.")

    def _end(self, won: bool) -> StepResult:
        if self._decides_first:
            text = "The corridor opens onto daylight. You won!" if won else "The corridor ends at a wall. You lost."
        else:
            text = "The door opens onto daylight. You won!" if won else "The door opens onto a wall. You lost."
        info = {**self._info(), "won": won}
        return StepResult(Observation(text, info), 1.0 if won else 0.0, True, info)

    def _continue(self, message: str) -> StepResult:
        info = {**self._info(), "won": False}
        result = StepResult(Observation(f"{message}\n{self._describe()}", info), 0.0, False, info)
        return self._end_at_step_limit(result, self._steps, self.config.max_steps)

    def _describe(self) -> str:
        if self._decides_first and self._opened is None:
            return f"Room 1. {self._door_list().capitalize()}. The sign says: {self._right}."
        if not self._decides_first and self._room == self.config.length - 1:
            return f"Room {self._room + 1}, the last. The sign says: {self._right}. Exits: west."
        exits = "east, west" if self._room > 0 else "east"
        return f"Room {self._room + 1}. The corridor goes on. Exits: {exits}."

    def _door_list(self) -> str:
        """``a red door and a blue door``, ``a red door, a blue door and a green door``, ..."""
        doors = [f"a {c} door" for c in self.colors]
        return f"{', '.join(doors[:-1])} and {doors[-1]}"

    def _info(self) -> dict[str, Any]:
        return {"admissible_commands": list(self.vocabulary), "steps": self._steps}

    # --- native snapshot ------------------------------------------------------------------------------------
    def _snapshot_payload(self) -> Any:
        return self._right, self._room, self._steps, self._opened

    def _restore_payload(self, snapshot: Snapshot) -> None:
        payload = snapshot.payload
        if not (isinstance(payload, tuple) and len(payload) == 4 and payload[0] in self.colors
                and payload[3] in (None, *self.colors)):
            raise RestoreFailed(f"signpost: snapshot payload is not a signpost state: {type(payload).__name__}")
        self._right, self._room, self._steps, self._opened = payload

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return ("You are an agent in a text game. Each turn, reply with exactly one action from: "
                f"{', '.join(self.vocabulary)}. Write it alone or as 'action: <action>'.")

    def invalid_action_text(self, text: str) -> str:
        return f"Invalid action. Reply with one of: {', '.join(self.vocabulary)}."
