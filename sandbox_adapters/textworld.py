"""``TextWorldSandbox``: the real TextWorld 1.7.0 engine (Inform7 games run by Jericho), with an in-place snapshot.

Games are ``.z8`` files made by ``tw-make`` (``make_games`` builds them, for the ``custom`` and ``tw-coin_collector``
challenges, with fixed seeds into a cache directory; the same seed gives a byte-identical story file).
``textworld.start`` plays a game through the wrapper stack TWInform7 -> StateTracking -> Inform7Data -> GameData ->
JerichoEnv. Everything that decides future observations and rewards lives in two places:

* the Z-machine inside Jericho (RAM, stack, program counter, RNG): ``FrotzEnv.get_state()/set_state()``, ~40 KB,
  tens of microseconds;
* TextWorld's Python-side tracking: ``StateTracking._game_progression`` (a ``GameProgression``, copied like its
  own ``copy()`` does but without rebuilding the initial state first),
  the winning-policy lists, ``_last_action``, ``_moves``, and each wrapper's current ``state`` dict (plus
  ``Inform7Data._prev_state``, from which tracked infos carry over).

The native snapshot stores exactly those (about 2 ms), which is ~100x cheaper than ``env.copy()`` (it deep-copies
the game state and reloads the story file), plus a shallow copy of each wrapper's remaining, read-only attributes
(the parsed ``Game``, its ``Inform7Game``, the requested infos). Those are private attributes of TextWorld, so the
test-suite checks that an in-place fork equals an ``env.copy()`` fork step by step; ``Config.snapshot="copy"``
switches to ``env.copy()`` and ``"replay"`` to the universal fallback.

Forks into fresh sandboxes (how the tree sampler forks): a sandbox that does not hold the game rebuilds the
wrapper stack from those attributes around a Z-machine and sets its state, without loading the game's ``.json``
or resetting. Each Z-machine is a private copy of ``libfrotz.so`` set up for one story file (~5 ms to make), so
the machines of closed sandboxes are kept (``Config.max_idle_engines`` per process) and handed to the next
sandbox, one already set up for the wanted story first; a fork then costs a fraction of a millisecond, and a few
milliseconds when no idle machine is left. A sandbox closed while one of its calls still runs (a quarantined,
hung call) drops its machine instead of recycling it.

Reward: the change of the game's score (divided by the maximum score when ``Config.normalize_reward``, so a won
game sums to 1.0); ``done`` when the game is won or lost or after ``Config.max_steps`` actions.

Task specification: ``{"game": "<path to a .z8>"}`` (relative paths resolve against ``Config.games_dir``) or
``{"task_id": i}``, the i-th ``.z8`` of ``Config.games_dir`` in sorted order.

Determinism and faults: ``tw-make`` games have no random events, the Z-machine's RNG is seeded with
``Config.seed`` at reset and travels with the snapshot, so the adapter is deterministic and ``reseed`` is a no-op.
The engine runs in this process, so there is no step timeout (Inform7 commands of these games always return);
an exception inside the engine becomes ``SandboxCrashed``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from sandbox_adapters.base import (
    Observation,
    RestoreFailed,
    Sandbox,
    SandboxCrashed,
    Snapshot,
    SnapshotKind,
    StepResult,
    parse_text_command,
)

__all__ = ["TextWorldSandbox", "CHALLENGES", "make_games", "game_walkthrough"]

# Inform7 prints a prompt and a status bar ("> ... -= Room =-0/3") after every turn; they only add noise.
_PROMPT_TAIL = re.compile(r"\n>[^\n]*\s*$")
# The game's verbs that open a file in the interpreter's working directory: "save" writes <game>.qzl there and
# "restore" reads it back (so one episode could load another's position), "script"/"transcript" write a transcript.
# Refused before the engine sees them (a turn without a command); no game's walkthrough uses them. An engine
# process's private directory (verl_bpo.rollout.engine_pool) keeps such files from the trainer's, but the episodes
# of one process share it.
FILE_VERBS = frozenset({"save", "restore", "script", "transcript"})
# Wrapper attributes that change from step to step (see the module docstring).
_TRACKED_ATTRS = (
    "_last_action",
    "_moves",
    "_previous_winning_policy",
    "_current_winning_policy",
    "_game_progression",
    "_prev_state",
    "state",
)
# Wrapper attributes a rebuilt stack gets from elsewhere (the chain links and the Z-machine).
_LINK_ATTRS = ("_wrapped_env", "_jericho")

# Z-machines of closed sandboxes: story file -> machines set up for it (see the module docstring).
_IDLE_VMS: dict[str, list[Any]] = {}
_IDLE_LOCK = threading.Lock()


def _take_vm(story: str, seed: int, set_up: bool = True) -> Any:
    """A Z-machine for ``story``: an idle one set up for it, else an idle one set up anew (left to the caller
    when not ``set_up``), else a new one."""
    with _IDLE_LOCK:
        vm = _IDLE_VMS[story].pop() if _IDLE_VMS.get(story) else None
        other = None
        if vm is None:
            other = next((machines.pop() for machines in _IDLE_VMS.values() if machines), None)
    if vm is not None:
        return vm
    import jericho

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jericho.UnsupportedGameWarning)
        if other is not None:
            if set_up:
                other.load(story, seed)
            return other
        return jericho.FrotzEnv(story, seed)


def _give_vm(vm: Any, story: str, limit: int) -> None:
    with _IDLE_LOCK:
        if sum(map(len, _IDLE_VMS.values())) < limit:
            _IDLE_VMS.setdefault(story, []).append(vm)
            return
    vm.close()  # over the limit: the machine is freed when it is collected


# The ``tw-make`` challenges ``make_games`` builds: file-name prefix and default settings (each a CLI flag).
CHALLENGES: dict[str, tuple[str, dict[str, int]]] = {
    # one quest of ``quest_length`` steps among ``nb_objects`` objects in ``world_size`` rooms
    "custom": ("tw", {"world_size": 3, "nb_objects": 6, "quest_length": 4}),
    # a chain of rooms to walk (the room's exits are listed) and a coin to take at its end; ``level`` 1-100 is the
    # chain's length with no dead ends, 101-200 and 201-300 add dead-end rooms
    "tw-coin_collector": ("cc", {"level": 5}),
}


def make_games(
    out_dir: str | os.PathLike,
    seeds: Iterable[int],
    *,
    challenge: str = "custom",
    workers: int = 2,
    **settings: int,
) -> list[Path]:
    """Generate ``tw-make <challenge>`` games with fixed seeds into ``out_dir`` and return their ``.z8`` paths.

    ``settings`` override the challenge's defaults (:data:`CHALLENGES`). A game is named after its challenge,
    settings and seed and is only generated when missing, so ``out_dir`` works as a cache. Each game takes about
    2-5 s; ``workers`` games are compiled in parallel.
    """
    if challenge not in CHALLENGES:
        raise ValueError(f"challenge must be one of {sorted(CHALLENGES)}, got {challenge!r}")
    prefix, defaults = CHALLENGES[challenge]
    unknown = set(settings) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {challenge} settings {sorted(unknown)}; known: {sorted(defaults)}")
    settings = {**defaults, **settings}
    stem = "_".join([prefix, *(f"{key[0]}{value}" for key, value in settings.items())])
    flags = [arg for key, value in settings.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tw_make = Path(sys.executable).with_name("tw-make")
    command = [str(tw_make)] if tw_make.exists() else [shutil.which("tw-make") or "tw-make"]

    def build(seed: int) -> Path:
        path = out / f"{stem}_s{seed}.z8"
        if path.exists() and path.with_suffix(".json").exists():
            return path
        args = [*command, challenge, *flags, "--seed", str(seed), "--output", str(path), "-f", "--silent"]
        # A fixed hash seed keeps the .json byte-stable too (it orders a set inside the grammar section).
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"tw-make failed for seed {seed}: {proc.stderr[-2000:]}")
        return path

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(build, list(seeds)))


def game_walkthrough(game_path: str | os.PathLike) -> list[str]:
    """The winning command sequence ``tw-make`` stored with the game."""
    import textworld

    return list(textworld.Game.load(str(Path(game_path).with_suffix(".json"))).walkthrough)


def _strip_banner(text: str) -> str:
    """``text`` without its leading lines that hold no letter (the ASCII-art title of a game's first turn)."""
    lines = text.split("\n")
    start = 0
    while start < len(lines) and not any(ch.isalpha() for ch in lines[start]):
        start += 1
    return "\n".join(lines[start:]) if start < len(lines) else text


def _copy_progression(progression: Any) -> Any:
    """``GameProgression.copy()`` without its wasted work.

    TextWorld's ``copy()`` first runs ``__init__``, which copies the game's *initial* state and computes all its
    applicable actions, only to overwrite both; that is ~95% of the copy's cost. This builds the same object
    (game by reference, the logic state copied, the valid-action list shared as TextWorld does, each quest
    progression copied) and falls back to ``copy()`` when the attribute set differs from what it knows.
    """
    known = {"game", "state", "_valid_actions", "quest_progressions"}
    if set(vars(progression)) != known:
        return progression.copy()
    new = object.__new__(type(progression))
    new.game = progression.game
    new.state = progression.state.copy()
    new._valid_actions = progression._valid_actions
    new.quest_progressions = [quest.copy() for quest in progression.quest_progressions]
    return new


def _copy_tracked(name: str, value: Any) -> Any:
    """A copy of one tracked wrapper attribute that later steps cannot change."""
    if value is None or name in ("_last_action", "_moves"):
        return value  # an immutable Action/int
    if name == "_game_progression":
        return _copy_progression(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):  # a GameState: shallow, its values are replaced (not mutated) each step
        return type(value)(value)
    raise TypeError(f"unexpected tracked attribute {name}={type(value).__name__}")


class TextWorldSandbox(Sandbox):
    """A TextWorld game; see the module docstring for snapshot, reward and task format."""

    @dataclasses.dataclass
    class Config:
        """Keys accepted under ``bpo.sandbox.config`` for ``name=textworld``.

        Attributes:
            games_dir: directory of ``.z8`` games (with their ``.json``) for ``{"task_id": i}`` tasks and for
                relative ``{"game": ...}`` paths (default None: tasks must give absolute paths).
            max_steps: turns after which the episode ends unwon, turns without a parseable command included
                (default 50).
            show_admissible: list the admissible commands in every observation (default True; small models need
                them to act at all).
            normalize_reward: divide score changes by the game's maximum score so a won game sums to 1.0
                (default True).
            snapshot: ``"native"`` (in-place VM state + tracking, ~2 ms), ``"copy"`` (TextWorld's ``env.copy()``,
                ~100-500 ms, the reference) or ``"replay"`` (reset + re-apply; default ``"native"``).
            seed: seed of the Z-machine's random number generator at reset (default 0; Jericho's default of -1
                would vary with time).
            max_idle_engines: Z-machines of closed sandboxes kept per process for reuse (default 64).
            strip_banner: drop the ASCII-art title (the leading lines without a letter) from the first observation
                (default False); it costs a small model's tokenizer a hundred tokens and carries nothing.
        """

        games_dir: str | None = None
        max_steps: int = 50
        show_admissible: bool = True
        normalize_reward: bool = True
        snapshot: str = "native"
        seed: int = 0
        max_idle_engines: int = 64
        strip_banner: bool = False

        def __post_init__(self) -> None:
            if self.snapshot not in ("native", "copy", "replay"):
                raise ValueError(f"textworld: snapshot must be native, copy or replay, got {self.snapshot!r}")
            if self.max_steps < 1:
                raise ValueError("textworld: max_steps must be >= 1")
            # Relative to where the sandbox is made, not to the private directory of the engine process it may be
            # shipped to (verl_bpo.rollout.engine_pool).
            if self.games_dir:
                self.games_dir = os.path.abspath(self.games_dir)

    # Concurrent resets on different instances corrupt TextWorld's shared grammar parser (seen in threads).
    thread_safe: ClassVar[bool] = False
    # So the tree sampler runs these sandboxes in engine processes of their own (verl_bpo.rollout.engine_pool):
    # concurrent trees step in parallel. This needs an un-reset sandbox to pickle (it holds only its config) and
    # the chat rendering to depend on the config and the observation alone.
    engine_process: ClassVar[bool] = True
    name: ClassVar[str] = "textworld"
    deterministic: ClassVar[bool] = True

    def __init__(self, config: TextWorldSandbox.Config | None = None) -> None:
        super().__init__()
        self.config = config or TextWorldSandbox.Config()
        self.snapshot_kind = SnapshotKind.REPLAY if self.config.snapshot == "replay" else SnapshotKind.NATIVE
        self._env: Any = None
        self._game_path: str | None = None
        self._steps = 0
        self._score = 0
        self._max_score = 1
        self._running = 0  # engine calls in flight; close() during one drops the Z-machine

    # --- games ----------------------------------------------------------------------------------------------
    def resolve_game(self, task: Mapping[str, Any]) -> str:
        """The absolute ``.z8`` path a task names."""
        games_dir = Path(self.config.games_dir) if self.config.games_dir else None
        if "game" in task:
            path = Path(task["game"])
            if not path.is_absolute():
                if games_dir is None:
                    raise ValueError(f"textworld: relative game {path} needs Config.games_dir")
                path = games_dir / path
        elif "task_id" in task:
            if games_dir is None:
                raise ValueError("textworld: {'task_id': i} tasks need Config.games_dir")
            games = sorted(games_dir.glob("*.z8"))
            if not 0 <= int(task["task_id"]) < len(games):
                raise ValueError(
                    f"textworld: task_id {task['task_id']} out of range, {len(games)} games in {games_dir}"
                )
            path = games[int(task["task_id"])]
        else:
            raise ValueError(f"textworld: a task needs 'game' or 'task_id', got {dict(task)}")
        if not path.exists():
            raise FileNotFoundError(f"textworld: no game at {path}")
        return str(path.resolve())

    def _load(self, game_path: str) -> None:
        """Start the engine on ``game_path`` unless it already runs that game (``textworld.start`` on a Z-machine
        of the pool)."""
        if self._env is not None and self._game_path == game_path:
            return
        import textworld
        from textworld.envs import JerichoEnv, TWInform7

        self._close_env()
        infos = textworld.EnvInfos(
            admissible_commands=True, score=True, max_score=True, won=True, lost=True, objective=True
        )
        vm = _take_vm(game_path, self.config.seed, set_up=False)
        jericho_env = JerichoEnv(infos)
        jericho_env._jericho = vm  # load() then sets this machine up for the story instead of making one
        env = TWInform7(jericho_env)
        self._env, self._game_path = env, game_path
        self._quiet(lambda: env.load(game_path))

    @staticmethod
    def _quiet(load: Any) -> Any:
        """Run ``load()`` (which loads a story file) without Jericho's unsupported-game warning.

        TextWorld games are "not fully supported" by Jericho, which only disables Jericho's own score detection;
        score and won come from TextWorld's tracking instead.
        """
        import jericho

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jericho.UnsupportedGameWarning)
            return load()

    def _wrappers(self) -> list[Any]:
        """The wrapper chain from the outside in, ending with the JerichoEnv."""
        chain, layer = [], self._env
        while layer is not None:
            chain.append(layer)
            layer = layer.__dict__.get("_wrapped_env")
        return chain

    @property
    def _jericho(self) -> Any:
        return self._env.unwrapped._jericho

    # --- engine hooks ---------------------------------------------------------------------------------------
    def _reset(self, task: Mapping[str, Any]) -> Observation:
        try:
            with self._engine_call():
                self._load(self.resolve_game(task))
                self._env.seed(self.config.seed)
                state = self._env.reset()
        except (ValueError, FileNotFoundError):
            raise
        except Exception as exc:
            raise SandboxCrashed(f"textworld: reset failed: {exc!r}") from exc
        self._steps = 0
        self._score = int(state["score"] or 0)
        self._max_score = max(1, int(state["max_score"] or 1))
        return Observation(self._render(state), self._info(state))

    def parse_action(self, text: str) -> str | None:
        command = parse_text_command(text)
        return None if command is None or command.split()[0] in FILE_VERBS else command

    def _step_text(self, action_text: str) -> StepResult:
        if self.parse_action(action_text) is not None:
            return super()._step_text(action_text)
        # a turn without a command counts towards max_steps too, so a model that never acts still ends
        result = super()._step_text(action_text)
        self._steps += 1
        return self._end_at_step_limit(result, self._steps, self.config.max_steps)

    def _apply(self, action: str) -> StepResult:
        admissible = self._env.state.get("admissible_commands") or []
        try:
            with self._engine_call():
                state, _, _ = self._env.step(action)
        except Exception as exc:
            raise SandboxCrashed(f"textworld: step {action!r} failed: {exc!r}") from exc
        self._steps += 1
        score = int(state["score"] or 0)
        reward = float(score - self._score)
        if self.config.normalize_reward:
            reward /= self._max_score
        self._score = score
        won, lost = bool(state["won"]), bool(state["lost"])
        truncated = not (won or lost) and self._steps >= self.config.max_steps
        info = {**self._info(state), "invalid_action": action not in admissible}
        if truncated:
            info["truncated"] = True
        return StepResult(Observation(self._render(state), info), reward, won or lost or truncated, info)

    def _render(self, state: Mapping[str, Any]) -> str:
        text = _PROMPT_TAIL.sub("", state["feedback"] or "").strip()
        if self.config.strip_banner:
            text = _strip_banner(text)
        commands = state.get("admissible_commands")
        if self.config.show_admissible and commands and not (state["won"] or state["lost"]):
            text += "\nAdmissible commands: " + ", ".join(commands) + "."
        return text

    def _info(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "won": bool(state["won"]),
            "lost": bool(state["lost"]),
            "score": int(state["score"] or 0),
            "max_score": int(state["max_score"] or 0),
            "admissible_commands": list(state.get("admissible_commands") or []),
        }

    # --- snapshots ------------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        if self.config.snapshot == "copy":
            # the payload holds a whole engine; free its Z-machine when the snapshot is released
            snap = dataclasses.replace(snap, release=snap.payload[2].close)
        return snap

    def _snapshot_payload(self) -> Any:
        counters = (self._game_path, self._steps, self._score, self._max_score)
        if self.config.snapshot == "copy":
            return ("copy", counters, self._quiet(self._env.copy))
        chain = self._wrappers()
        layers = [
            {name: _copy_tracked(name, layer.__dict__[name]) for name in _TRACKED_ATTRS if name in layer.__dict__}
            for layer in chain
        ]
        # the rest of each wrapper is set by load/reset and read-only afterwards: shared, not copied
        static = tuple((type(layer), {name: value for name, value in layer.__dict__.items()
                                      if name not in _TRACKED_ATTRS and name not in _LINK_ATTRS})
                       for layer in chain)
        return ("native", counters, (self._jericho.get_state(), layers, static))

    def _restore_payload(self, snapshot: Snapshot) -> None:
        if self.config.snapshot == "replay" or snapshot.kind is SnapshotKind.REPLAY:
            super()._restore_payload(snapshot)
            return
        payload = snapshot.payload
        if not (isinstance(payload, tuple) and len(payload) == 3 and payload[0] in ("native", "copy")):
            raise RestoreFailed(f"textworld: not a TextWorld snapshot payload: {type(payload).__name__}")
        with self._engine_call():
            self._restore_engine(*payload)

    def _restore_engine(self, mode: str, counters: tuple, data: Any) -> None:
        game_path, steps, score, max_score = counters
        if mode == "copy":
            self._close_env()
            self._env = self._quiet(data.copy)  # the snapshot keeps its own copy untouched
            self._game_path = game_path
        else:
            vm_state, layers, static = data
            if self._env is None or self._game_path != game_path:
                self._rebuild(game_path, static)
            chain = self._wrappers()
            if len(chain) != len(layers):
                raise RestoreFailed("textworld: snapshot was taken from a different wrapper stack")
            self._jericho.set_state(vm_state)
            for layer, saved in zip(chain, layers, strict=True):
                for name, value in saved.items():
                    layer.__dict__[name] = _copy_tracked(name, value)
        self._steps, self._score, self._max_score = steps, score, max_score

    def _rebuild(self, game_path: str, static: tuple) -> None:
        """A wrapper stack for ``game_path`` from a snapshot's read-only wrapper attributes around a Z-machine of
        the pool, without loading the game or resetting it (the caller sets the state)."""
        if not os.path.isfile(game_path):
            raise FileNotFoundError(f"textworld: no game at {game_path}")
        self._close_env()
        chain = []
        for cls, attrs in static:
            layer = object.__new__(cls)
            layer.__dict__.update(attrs)
            chain.append(layer)
        for outer, inner in zip(chain, chain[1:]):
            outer.__dict__["_wrapped_env"] = inner
        chain[-1].__dict__["_jericho"] = self._quiet(lambda: _take_vm(game_path, self.config.seed))
        self._env, self._game_path = chain[0], game_path

    # --- lifecycle ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _engine_call(self) -> Iterator[None]:
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1

    def _close_env(self) -> None:
        """Detach the Z-machine for the next sandbox (or drop it while a call still runs) and forget the stack."""
        env, game_path, self._env, self._game_path = self._env, self._game_path, None, None
        if env is None:
            return
        jericho_env = env.unwrapped
        vm, jericho_env._jericho, jericho_env._reset = jericho_env._jericho, None, False
        if vm is not None and not self._running and game_path is not None:
            _give_vm(vm, game_path, self.config.max_idle_engines)

    def close(self) -> None:
        self._close_env()

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return (
            "You are playing a text adventure game. Each turn, reply with exactly one command, e.g. "
            "'go north' or 'take key'. Write it alone or on a line 'action: <command>'. Prefer the admissible "
            "commands listed after each observation."
        )
