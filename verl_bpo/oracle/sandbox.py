"""The tabular MDP as a real :class:`~sandbox_adapters.base.Sandbox` (registered as ``tabular``).

Every property the tree sampler relies on is the production one: a native snapshot of (t, x, random state),
``restore(snapshot, seed)`` re-seeds the transition and failure draws so siblings are independent, episodes stop
at random depths, and a step may crash (``fail_prob``) with :class:`~sandbox_adapters.base.SandboxCrashed`.

Text protocol (see :mod:`verl_bpo.oracle.policy`): an observation reads ``state <t> <x>``, an action ``a<k>``.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from sandbox_adapters.base import Observation, RestoreFailed, Sandbox, SandboxCrashed, SnapshotKind, StepResult
from sandbox_adapters.registry import register_sandbox
from verl_bpo.oracle.mdp import TabularMDP, problem

__all__ = ["TabularSandbox", "state_text", "parse_state"]

_STATE = re.compile(r"^state (\d+) (\d+)$")
_ACTION = re.compile(r"^a(\d+)$")


def state_text(t: int, x: int) -> str:
    return f"state {t} {x}"


def parse_state(text: str) -> tuple[int, int] | None:
    match = _STATE.match(text.strip())
    return (int(match[1]), int(match[2])) if match else None


@register_sandbox("tabular")
class TabularSandbox(Sandbox):
    """One episode of a tabular problem from :data:`verl_bpo.oracle.mdp.PROBLEMS`."""

    @dataclasses.dataclass
    class Config:
        """Keys under ``bpo.sandbox.config`` for ``name=tabular``.

        Attributes:
            problem: a name in :data:`verl_bpo.oracle.mdp.PROBLEMS` (default ``random``).
            problem_args: its keyword arguments (e.g. ``{"seed": 1, "gamma": 0.9, "stop_prob": 0.3}``).
            fail_prob: probability that a step crashes (default 0).
            seed: seed of the transition and failure draws at reset (default 0).
        """

        problem: str = "random"
        problem_args: dict[str, Any] = dataclasses.field(default_factory=dict)
        fail_prob: float = 0.0
        seed: int = 0

        def __post_init__(self) -> None:
            if not 0.0 <= self.fail_prob < 1.0:
                raise ValueError(f"tabular: fail_prob must be in [0, 1), got {self.fail_prob}")

    name: ClassVar[str] = "tabular"
    blocking: ClassVar[bool] = False  # microseconds per call, nothing to wait on
    deterministic: ClassVar[bool] = False
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.NATIVE

    def __init__(self, config: TabularSandbox.Config | None = None) -> None:
        super().__init__()
        self.config = config or TabularSandbox.Config()
        self.mdp: TabularMDP = problem(self.config.problem, **self.config.problem_args)[0]
        self._t, self._x = 0, 0
        self._rng = random.Random(self.config.seed)

    def _reset(self, task: Mapping[str, Any]) -> Observation:
        self._t, self._x = 0, 0
        self._rng = random.Random(self.config.seed)
        return Observation(state_text(0, 0))

    def parse_action(self, text: str) -> str | None:
        match = _ACTION.match(text.strip())
        return text.strip() if match and int(match[1]) < self.mdp.n_actions else None

    def _apply(self, action: str) -> StepResult:
        cdf, reward, success, stop = self.mdp.tables
        t, x, a = self._t, self._x, int(action[1:])
        if self._rng.random() < self.config.fail_prob:
            raise SandboxCrashed(f"tabular: injected failure at turn {t}")
        x_next = bisect.bisect_right(cdf[t][x][a], self._rng.random())
        r = reward[t][x][a][x_next]
        done = self._rng.random() < stop[t][x][a]
        won = done and self._rng.random() < success[x][a][x_next]
        self._t, self._x = t + 1, x_next
        info = {"won": won}
        return StepResult(Observation("end" if done else state_text(t + 1, x_next), info), r + won, done, info)

    def _snapshot_payload(self) -> Any:
        return self._t, self._x, self._rng.getstate()

    def _restore_payload(self, snapshot: Any) -> None:
        payload = snapshot.payload
        if not (isinstance(payload, tuple) and len(payload) == 3):
            raise RestoreFailed(f"tabular: not a tabular snapshot payload: {type(payload).__name__}")
        self._t, self._x = payload[0], payload[1]
        self._rng = random.Random()
        self._rng.setstate(payload[2])

    def reseed(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def system_prompt(self) -> str:
        return f"tabular {self.config.problem}"
