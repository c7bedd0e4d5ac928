"""``SmokeSandbox``: a tiny, pure-Python "find the key, open the door" corridor for demos and tests.

The agent stands in a corridor of ``Config.length`` rooms. One room holds a key, one room has a locked door; both
(and the start room) depend on the task id, so different tasks have different answers. The episode is won (reward
1.0, done) when the agent opens the door while holding the key; it ends with reward 0 after ``Config.max_steps``
actions. A step takes microseconds and a snapshot is a copy of five small values, so the CPU demo and the tree
sampler tests can fork it freely.

Actions (the whole vocabulary): ``west``, ``east``, ``take key``, ``open door``, ``look``. The model may write the
action alone (``east``) or on a line ``action: east``; ``go east`` is accepted too, and so is a reply that starts
with an action and runs on (``east key key``). With ``Config.slip_prob > 0``
moves fail at random (seeded, re-seeded by ``restore(..., seed)``), which makes the sandbox stochastic.

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

__all__ = ["SmokeSandbox", "ACTIONS"]

ACTIONS: tuple[str, ...] = ("west", "east", "take key", "open door", "look")
_ALIASES = {"go west": "west", "go east": "east", "take the key": "take key", "open the door": "open door"}


@dataclasses.dataclass
class _State:
    """Everything that determines future observations and rewards (the native snapshot copies it)."""

    room: int
    has_key: bool
    steps: int
    rng_state: tuple | None


class SmokeSandbox(Sandbox):
    """The corridor environment; see the module docstring for the rules and the action vocabulary."""

    @dataclasses.dataclass
    class Config:
        """Keys accepted under ``bpo.sandbox.config`` for ``name=smoke``.

        Attributes:
            length: number of rooms in the corridor (default 4; at least 2).
            num_tasks: how many task ids exist (default 8); task ``i`` has its own key, door and start rooms.
            max_steps: turns after which the episode ends unwon (default 12); turns without a valid action count
                too, so a model that never acts still ends its episode.
            slip_prob: probability that a move leaves the agent where it was (default 0.0 = deterministic).
            seed: seed of the slip random number generator at reset (default 0; only used when ``slip_prob > 0``).
            key_reward: reward for picking up the key (default 0.0). A shaping reward: it gives a barely trained
                model's rollouts different returns more often, so short runs and tests see learning signal.
            invalid_penalty: reward subtracted for a turn without a valid action (default 0.0). Without it, a
                policy that loses the output format (e.g. stops ending its turns) earns 0 everywhere, every
                advantage is 0, and nothing pulls it back; with it, valid turns keep winning comparisons.
        """

        length: int = 4
        num_tasks: int = 8
        max_steps: int = 12
        slip_prob: float = 0.0
        seed: int = 0
        key_reward: float = 0.0
        invalid_penalty: float = 0.0

        def __post_init__(self) -> None:
            if self.length < 2:
                raise ValueError(f"smoke: length must be >= 2, got {self.length}")
            if self.num_tasks < 1 or self.max_steps < 1:
                raise ValueError("smoke: num_tasks and max_steps must be >= 1")
            if not 0.0 <= self.slip_prob < 1.0:
                raise ValueError(f"smoke: slip_prob must be in [0, 1), got {self.slip_prob}")

    name: ClassVar[str] = "smoke"
    blocking: ClassVar[bool] = False  # microseconds per call, nothing to wait on
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.NATIVE

    def __init__(self, config: SmokeSandbox.Config | None = None) -> None:
        super().__init__()
        self.config = config or SmokeSandbox.Config()
        # An instance attribute shadows the class default: only a slipping corridor is stochastic.
        self.deterministic = self.config.slip_prob == 0.0
        self._layout: tuple[int, int, int] = (0, 0, 0)
        self._state = _State(room=0, has_key=False, steps=0, rng_state=None)
        self._rng = random.Random(self.config.seed)

    # --- layout ---------------------------------------------------------------------------------------------
    def layout(self, task: Mapping[str, Any]) -> tuple[int, int, int]:
        """``(start_room, key_room, door_room)`` of a task; key and door rooms always differ."""
        task_id = int(task["task_id"])
        if not 0 <= task_id < self.config.num_tasks:
            raise ValueError(f"smoke: task_id must be in [0, {self.config.num_tasks}), got {task_id}")
        # A private generator per task id: layouts do not depend on the slip seed or on Python's hash seed.
        rng = random.Random(10_007 * task_id + self.config.length)
        key_room, door_room = rng.sample(range(self.config.length), 2)
        return rng.randrange(self.config.length), key_room, door_room

    def solution(self, task: Mapping[str, Any]) -> list[str]:
        """A shortest winning action sequence (the task's answer)."""
        start, key_room, door_room = self.layout(task)

        def walk(src: int, dst: int) -> list[str]:
            return ["east" if dst > src else "west"] * abs(dst - src)

        return [*walk(start, key_room), "take key", *walk(key_room, door_room), "open door"]

    def best_action(self) -> str:
        """The first action of a shortest win from the current state (it knows where the key and door are, which
        the agent only learns by walking; warm starts imitate it, mixed with random actions)."""
        _, key_room, door_room = self._layout
        state = self._state
        goal = door_room if state.has_key else key_room
        if state.room == goal:
            return "open door" if state.has_key else "take key"
        return "east" if goal > state.room else "west"

    # --- engine hooks ---------------------------------------------------------------------------------------
    def _reset(self, task: Mapping[str, Any]) -> Observation:
        self._layout = self.layout(task)
        self._rng = random.Random(self.config.seed)
        self._state = _State(room=self._layout[0], has_key=False, steps=0, rng_state=None)
        intro = (
            f"You are in a corridor of {self.config.length} rooms, numbered 1 to {self.config.length} from west "
            "to east. Find the key, then open the locked door."
        )
        return Observation(f"{intro}\n{self._describe()}", self._info())

    def parse_action(self, text: str) -> str | None:
        return match_action(text, ACTIONS, _ALIASES)

    def _step_text(self, action_text: str) -> StepResult:
        result = super()._step_text(action_text)
        if not result.info.get("invalid_action"):
            return result
        self._state.steps += 1
        reward = -self.config.invalid_penalty
        if self._state.steps < self.config.max_steps:
            return dataclasses.replace(result, reward=reward)
        info = {**result.info, **self._info(), "won": False}
        return StepResult(Observation(f"{result.observation.text}\nYou ran out of steps.", info), reward, True, info)

    def _apply(self, action: str) -> StepResult:
        try:
            return self._transition(action)
        except Exception as exc:  # a bug in the engine must end one leaf, not the tree
            raise SandboxCrashed(f"smoke: step {action!r} failed: {exc!r}") from exc

    def _transition(self, action: str) -> StepResult:
        state = self._state
        _, key_room, door_room = self._layout
        state.steps += 1
        won, reward = False, 0.0
        if action in ("west", "east"):
            target = state.room + (1 if action == "east" else -1)
            if not 0 <= target < self.config.length:
                message = "A wall blocks the way."
            elif self.config.slip_prob and self._rng.random() < self.config.slip_prob:
                message = "You slip and stay where you are."
            else:
                state.room = target
                message = f"You walk {action}."
        elif action == "take key":
            if state.room == key_room and not state.has_key:
                state.has_key = True
                reward = self.config.key_reward
                message = "You take the key."
            else:
                message = "There is no key here."
        elif action == "open door":
            if state.room != door_room:
                message = "There is no door here."
            elif not state.has_key:
                message = "The door is locked. You need the key."
            else:
                won = True
                message = "You unlock the door and step outside. You won!"
        else:  # look
            message = "You look around."
        done = won or state.steps >= self.config.max_steps
        text = message if won else f"{message}\n{self._describe()}"
        if done and not won:
            text += "\nYou ran out of steps."
        info = {**self._info(), "won": won}
        return StepResult(Observation(text, info), 1.0 if won else reward, done, info)

    def _describe(self) -> str:
        state = self._state
        _, key_room, door_room = self._layout
        things = []
        if state.room == key_room and not state.has_key:
            things.append("a key")
        if state.room == door_room:
            things.append("a locked door")
        seen = f"You see {' and '.join(things)}." if things else "The room is empty."
        exits = [d for d, ok in (("west", state.room > 0), ("east", state.room < self.config.length - 1)) if ok]
        held = "You hold the key." if state.has_key else "You hold nothing."
        return f"Room {state.room + 1}. {seen} {held} Exits: {', '.join(exits)}."

    def _info(self) -> dict[str, Any]:
        return {"admissible_commands": list(ACTIONS), "steps": self._state.steps}

    # --- native snapshot ------------------------------------------------------------------------------------
    def _snapshot_payload(self) -> Any:
        state = dataclasses.replace(self._state, rng_state=self._rng.getstate())
        return (self._layout, state)

    def _restore_payload(self, snapshot: Snapshot) -> None:
        payload = snapshot.payload
        if not (isinstance(payload, tuple) and len(payload) == 2 and isinstance(payload[1], _State)):
            raise RestoreFailed(f"smoke: snapshot payload is not a smoke state: {type(payload).__name__}")
        layout, state = payload
        # Copy, never alias: children must not write into the snapshot.
        self._layout = tuple(layout)
        self._state = dataclasses.replace(state, rng_state=None)
        self._rng = random.Random()
        self._rng.setstate(state.rng_state)

    def reseed(self, seed: int) -> None:
        self._rng = random.Random(seed)

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return (
            "You are an agent in a text game. Each turn, reply with exactly one action from: "
            f"{', '.join(ACTIONS)}. Write it alone or as 'action: <action>'."
        )

    def invalid_action_text(self, text: str) -> str:
        return f"Invalid action. Reply with one of: {', '.join(ACTIONS)}."
