"""The sandbox protocol every BPO environment implements, and the replay snapshot fallback.

BPO forks a sandbox at a decision point: ``snapshot()`` captures everything that determines future observations
and rewards, and ``restore(snapshot, seed)`` turns a sandbox (a fresh one or the same one) into an exact,
independent copy of that state, with its random number generator re-seeded so that the K children of a fork
get independent transitions: each child is then a fresh sample of the state's future, which the tree's Monte Carlo
values need to be unbiased.

The contract, small on purpose (OpenRLHF's reset/step plus snapshot/restore):

* ``reset(task) -> Observation`` and ``step(action_text) -> StepResult``. ``action_text`` is the model's raw
  turn; the adapter parses it. Text that does not parse, or an action the engine rejects, is an *observation*
  saying so (reward 0, not done) — never an exception.
* ``snapshot() -> Snapshot`` / ``restore(snapshot, seed=None)``. A snapshot is immutable from the outside:
  restoring from it any number of times, into any sandbox of the same class, never changes it.
* ``close()`` releases every process, mount and temporary directory the sandbox made.
* Chat rendering: ``system_prompt()``, ``first_user_message(observation)`` (together ``opening_chat(observation)``),
  ``render_observation(obs)``.

Engine faults (a crash, a hang past ``step_timeout_s``, a restore that fails) raise a subclass of
:class:`SandboxError`. The tree sampler retries a failed step from the state before it (``bpo.step_retries``); one
that still fails ends its leaf, never the tree. Only faults outside the agent's reach may raise: whatever an agent's
action can cause is its outcome.

Nothing here imports verl.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

__all__ = [
    "Observation",
    "StepResult",
    "SnapshotKind",
    "Snapshot",
    "SandboxError",
    "SandboxCrashed",
    "SandboxTimeout",
    "RestoreFailed",
    "Sandbox",
    "ACTION_LINE",
    "parse_text_command",
    "match_action",
]

# ``action: <command>`` on a line of its own; the last such line wins.
ACTION_LINE = re.compile(r"^\s*action\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def parse_text_command(text: str, patterns: Sequence[re.Pattern] = (ACTION_LINE,), max_chars: int = 120) -> str | None:
    """A text-game command from a model turn: the last match of the first pattern that matches, else the whole
    reply when it is a single line; normalised to lower case without quotes or a trailing period. ``None`` for
    free text over several lines, an empty command, or one longer than ``max_chars`` (text engines such as Jericho
    truncate long input anyway; anything that long is not a command). Characters that are not printable are
    dropped: the Z-machine interpreter under TextWorld reads control characters as hot keys (0x0e starts recording
    the input into a file named by the command, in the engine's working directory; 0x0f replays one), and a
    byte-level tokenizer can sample any of them."""
    for pattern in patterns:
        found = pattern.findall(text)
        if found:
            candidate = found[-1]
            break
    else:
        candidate = text.strip()
        if "\n" in candidate:
            return None
    candidate = "".join(ch for ch in candidate if ch.isprintable() or ch.isspace())
    candidate = " ".join(candidate.strip().strip("`'\"").rstrip(".!").lower().split())
    if not candidate or len(candidate) > max_chars:
        return None
    return candidate


def match_action(text: str, actions: Sequence[str], aliases: Mapping[str, str] | None = None) -> str | None:
    """One of a fixed vocabulary of ``actions`` from a model turn: its last ``action:`` line, else the whole reply,
    normalised (lower case, no quotes or trailing period) and mapped through ``aliases``. A reply that starts with
    an action and rambles on ("take key key key", a turn cut at its token limit) still acts: losing the end-of-turn
    habit should cost tokens, not make every episode unwinnable."""
    lines = ACTION_LINE.findall(text)
    candidate = " ".join((lines[-1] if lines else text).lower().strip().strip(".!`'\"").split())
    candidate = (aliases or {}).get(candidate, candidate)
    return next((a for a in sorted(actions, key=len, reverse=True)
                 if candidate == a or candidate.startswith(a + " ")), None)


# ---------------------------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the agent sees after a reset or a step.

    Attributes:
        text: the observation as plain text (timing strings and other nondeterministic noise removed).
        info: engine-specific extras (admissible commands, score, ...); JSON-able values only.
    """

    text: str
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of one ``step``.

    Attributes:
        observation: the next observation.
        reward: the reward of this step (success rewards usually arrive on the final step).
        done: True when the episode ended (won, lost, or the engine's own step limit).
        info: extras such as ``{"invalid_action": True}`` or ``{"won": True}``.
    """

    observation: Observation
    reward: float
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class SnapshotKind(str, enum.Enum):
    """How a snapshot captures state."""

    NATIVE = "native"  # the engine's own get/set state (Jericho VM state, deep copy of in-process state)
    FILESYSTEM = "filesystem"  # overlayfs layer, in-memory file dict or git tree
    PROCESS_FORK = "process_fork"  # os.fork of a single-threaded engine worker
    REPLAY = "replay"  # reset + re-apply the action history: universal, slow, exact for deterministic engines


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """An opaque, immutable capture of a sandbox state.

    Attributes:
        kind: which mechanism made it.
        task: the task the sandbox was reset with.
        actions: the raw action texts applied since reset (kept for every kind: replay is the reference).
        payload: the mechanism's own data; only the sandbox class that made it reads it.
        done: the episode had ended when the snapshot was taken; a sandbox restored from it stays ended (a
            restored post-win state must not pay its reward again).
        release: optional callback that frees resources held by the payload (a frozen layer, a worker).
    """

    kind: SnapshotKind
    task: Mapping[str, Any]
    actions: tuple[str, ...]
    payload: Any = None
    done: bool = False
    release: Callable[[], None] | None = dataclasses.field(default=None, compare=False, repr=False)

    def close(self) -> None:
        """Free what the payload holds; a no-op for snapshots that hold only memory."""
        if self.release is not None:
            self.release()


# ---------------------------------------------------------------------------------------------------------------
# Errors: each one is retried, then ends one leaf, never the tree


class SandboxError(RuntimeError):
    """Base class of engine faults. The sampler retries the step; after ``bpo.step_retries`` it marks the leaf
    failed (reward 0) and goes on."""


class SandboxCrashed(SandboxError):
    """The engine raised or its process died while stepping or resetting."""


class SandboxTimeout(SandboxError):
    """A step or reset ran past its time limit; the engine has been stopped."""


class RestoreFailed(SandboxError):
    """``restore`` could not rebuild the snapshot's state."""


# ---------------------------------------------------------------------------------------------------------------
# The protocol


class Sandbox(abc.ABC):
    """Base class of every environment adapter.

    Subclasses implement ``_reset``, ``_apply`` (one parsed action), ``parse_action``, and either override
    ``_snapshot_payload`` / ``_restore_payload`` for a fast native snapshot or keep the replay fallback.
    The base class keeps the action history, so replay is always available as the reference.

    Class attributes:
        name: registry name (``bpo.sandbox.name``).
        thread_safe: False when instances must not be called concurrently from several threads.
        blocking: False for pure in-process engines whose calls take microseconds and cannot hang; the sampler then
            calls them on its event loop instead of a worker thread (which would cost ~100x the call).
        deterministic: True when the same state + the same action always gives the same transition.
        snapshot_kind: the mechanism ``snapshot()`` uses.
    """

    name: ClassVar[str] = ""
    # False when the engine keeps process-global state that concurrent calls on *different* instances corrupt
    # (TextWorld's grammar parser); the tree sampler then runs one call of that class at a time.
    thread_safe: ClassVar[bool] = True
    blocking: ClassVar[bool] = True
    deterministic: ClassVar[bool] = True
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.REPLAY

    def __init__(self) -> None:
        self._task: Mapping[str, Any] | None = None
        self._actions: list[str] = []
        self._done = False

    # --- engine hooks ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _reset(self, task: Mapping[str, Any]) -> Observation:
        """Start the task from its initial state."""

    @abc.abstractmethod
    def _apply(self, action: str) -> StepResult:
        """Apply one parsed action to the engine."""

    @abc.abstractmethod
    def parse_action(self, text: str) -> str | None:
        """Extract the action from the model's turn; ``None`` when there is none."""

    def _snapshot_payload(self) -> Any:
        """Capture engine state for a NATIVE/FILESYSTEM/PROCESS_FORK snapshot. Replay needs none."""
        return None

    def _restore_payload(self, snapshot: Snapshot) -> None:
        """Rebuild engine state from ``snapshot.payload``. The default replays the action history."""
        self._reset(snapshot.task)
        for text in snapshot.actions:
            self._step_text(text)

    def reseed(self, seed: int) -> None:
        """Re-seed the engine's random number generator (stochastic engines override this)."""

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        """The system message of the chat: what the agent is and how to format an action."""
        return "You are an agent acting in a text environment. Answer with one action per turn."

    def first_user_message(self, observation: Observation) -> str:
        """The first user message: the task instruction and the initial observation."""
        return observation.text

    def opening_chat(self, observation: Observation) -> list[dict[str, str]]:
        """The chat an episode starts from: the system prompt and the first user message."""
        return [{"role": "system", "content": self.system_prompt()},
                {"role": "user", "content": self.first_user_message(observation)}]

    def render_observation(self, observation: Observation) -> str:
        """A later observation as the content of a user message."""
        return observation.text

    def _end_at_step_limit(self, result: StepResult, steps: int, max_steps: int) -> StepResult:
        """For adapters whose step budget also counts turns without an action (so a model that never acts still
        ends its episode): ``result`` unchanged below the budget, else the same observation ending the episode."""
        if steps < max_steps:
            return result
        info = {**result.info, "won": False, "truncated": True}
        return StepResult(Observation(result.observation.text, info), 0.0, True, info)

    def invalid_action_text(self, text: str) -> str:
        """Observation returned when ``parse_action`` finds no action in the model's turn."""
        return "Invalid action: no action found in your reply. Reply with exactly one action."

    # --- the public protocol --------------------------------------------------------------------------------
    @property
    def task(self) -> Mapping[str, Any]:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}: call reset(task) before using the sandbox")
        return self._task

    @property
    def done(self) -> bool:
        """True once the episode ended (``step`` then raises); a restore takes the snapshot's value."""
        return self._done

    @property
    def actions(self) -> tuple[str, ...]:
        """Raw action texts applied since the last reset or restore point."""
        return tuple(self._actions)

    def reset(self, task: Mapping[str, Any]) -> Observation:
        self._task = dict(task)
        self._actions = []
        self._done = False
        return self._reset(self._task)

    def step(self, action_text: str) -> StepResult:
        if self._done:
            raise RuntimeError(f"{type(self).__name__}: step() after the episode ended")
        result = self._step_text(action_text)
        self._actions.append(action_text)
        self._done = result.done
        return result

    def _step_text(self, action_text: str) -> StepResult:
        action = self.parse_action(action_text)
        if action is None:
            obs = Observation(self.invalid_action_text(action_text))
            return StepResult(obs, 0.0, False, {"invalid_action": True})
        return self._apply(action)

    def snapshot(self) -> Snapshot:
        payload = None if self.snapshot_kind is SnapshotKind.REPLAY else self._snapshot_payload()
        return Snapshot(self.snapshot_kind, dict(self.task), tuple(self._actions), payload, done=self._done)

    def restore(self, snapshot: Snapshot, seed: int | None = None) -> None:
        """Make this sandbox an exact, independent copy of ``snapshot`` (an ended episode stays ended); then
        re-seed it if ``seed`` is given."""
        try:
            self._restore_payload(snapshot)
        except SandboxError:
            raise
        except Exception as exc:  # an engine-specific failure becomes the typed error the sampler handles
            raise RestoreFailed(f"{type(self).__name__}.restore failed: {exc!r}") from exc
        self._task = dict(snapshot.task)
        self._actions = list(snapshot.actions)
        self._done = snapshot.done
        if seed is not None:
            self.reseed(seed)

    def close(self) -> None:
        """Release processes, mounts and temporary directories. Safe to call twice."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
