"""``ALFWorldSandbox``: the real ALFWorld 0.4.2 text engine, played like verl-agent plays it, with a fast snapshot.

Engine: TextWorld's gym environment over ``game.tw-pddl`` files (``textworld.gym.register_games`` with the wrappers
``AlfredDemangler(shuffle=False)`` and ``AlfredInfos``, batch size 1, synchronous), which runs TextWorld's
``PddlEnv`` on a private copy of fast-downward's ``libdownward.so``.

Games: our own small ALFRED-format problems (``sandbox_adapters.alfworld.gen``, converted by the real
``alfworld-generate``), or the official ALFWorld data unchanged. With ``Config.data_dir`` unset the adapter reads
``$ALFWORLD_DATA``, laid out as ``alfworld-download`` leaves it::

    $ALFWORLD_DATA/json_2.1.1/{train,valid_seen,valid_unseen}/<task>-<Obj>-<Mrecep>-<Recep>-<scene>/<trial>/
        traj_data.json  game.tw-pddl  [initial_state.pddl]

and keeps, like ALFWorld's ``AlfredTWEnv``, only solvable games of the selected task types outside ``movable`` and
``Sliced`` trials. Task specification: ``{"game": "<path to a game.tw-pddl>"}`` or ``{"task_id": i}``, the i-th
game of ``Config.split`` in sorted path order.

Snapshot: ``PddlEnv.copy()`` is not implemented and ``libdownward`` has no get/set-state call, so the default
``Config.snapshot="sas"`` keeps the game's already-translated SAS task and the operator ids applied since reset,
plus references to the game's loaded, read-only parts (its PDDL data, the parsed ``GameLogic`` with its text
grammar, the demangled entity names). Restore reloads the SAS text into an engine's library, re-applies those
operators in C and puts back copies of the Python-side facts and game state. It never re-translates the PDDL,
also not into a **fresh** sandbox (which is how the tree sampler forks): the game's loaded parts are attached to
any engine, so a fork costs milliseconds with an idle engine and one library load (~50 ms) without one, against
seconds for a translation or a replay on realistic scenes. These are private TextWorld internals, so a test checks
the fast restore, into the same and into fresh sandboxes, against ``snapshot="replay"`` (reset + re-apply the
actions), the reference.

Engines: each one loads its own copy of ``libdownward.so`` (~34 MB, ~50 ms) and a loaded copy is never unloaded,
so the engines of closed sandboxes are kept and handed to the next sandbox, one that already holds the wanted
game first (a process holds as many engines as it ever ran sandboxes at once). A sandbox closed while one of its
calls still runs (a call that hung and was quarantined) drops its engine instead: it is in an unknown state.

Reward 1.0 on the step that wins (ALFWorld's score), ``done`` when won or after ``Config.max_steps`` actions.
Commands outside the admissible list are still sent (the engine answers "Nothing happens.") and are flagged
``info["invalid_action"]``.

Determinism and faults: PDDL transitions and ALFWorld's text grammar have no randomness (the demangler runs with
``shuffle=False``), so ``reseed`` is a no-op. The engine runs in this process, so there is no step timeout; an
exception inside it becomes ``SandboxCrashed`` and its engine is discarded rather than recycled.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from sandbox_adapters.alfworld.gen import TASK_TYPES, find_games
from sandbox_adapters.base import (
    ACTION_LINE,
    Observation,
    RestoreFailed,
    Sandbox,
    SandboxCrashed,
    Snapshot,
    SnapshotKind,
    StepResult,
    parse_text_command,
)

__all__ = ["ALFWorldSandbox", "game_walkthrough", "resolve_games_dir"]

_ACTION_TAG = re.compile(r"<action>\s*(.+?)\s*</action>", re.IGNORECASE | re.DOTALL)

# Engines of closed sandboxes (see the module docstring), oldest first; each knows its game as ``_bpo_game``.
_IDLE_ENGINES: list[Any] = []
_IDLE_LOCK = threading.Lock()
_INFOS_LOCK = threading.Lock()


def _take_idle_engine(game: str | None) -> Any:
    """An idle engine, one that holds ``game`` if there is one; None when none is idle."""
    with _IDLE_LOCK:
        for i in range(len(_IDLE_ENGINES) - 1, -1, -1):
            if getattr(_IDLE_ENGINES[i], "_bpo_game", None) == game:
                return _IDLE_ENGINES.pop(i)
        return _IDLE_ENGINES.pop() if _IDLE_ENGINES else None


def _wrapper_chain(engine: Any) -> list[Any]:
    """The layers of the engine's single environment, outermost first, down to the ``PddlEnv``."""
    chain, layer = [], engine.batch_env.envs[0]
    while layer is not None:
        chain.append(layer)
        layer = layer.__dict__.get("_wrapped_env")
    return chain


@dataclasses.dataclass(frozen=True)
class _LoadedGame:
    """The read-only products of ``PddlEnv.load`` for one game: what a translation would rebuild."""

    game_data: Any
    walkthrough: Any
    logic: Any
    entity_infos: Any


def _absolute(path: str | None) -> str | None:
    """``path`` with ``~`` expanded, made absolute against the current directory (None and "" stay as they are)."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def resolve_games_dir(data_dir: str | os.PathLike | None, split: str) -> Path:
    """The folder holding a split's trials: ``<data>/json_2.1.1/<split>``, else ``<data>/<split>``, else ``<data>``.

    ``data_dir`` None means ``$ALFWORLD_DATA``.
    """
    if data_dir is None:
        if not os.environ.get("ALFWORLD_DATA"):
            raise ValueError("alfworld: set Config.data_dir or the ALFWORLD_DATA environment variable")
        data_dir = os.environ["ALFWORLD_DATA"]
    root = Path(data_dir).expanduser()
    for candidate in (root / "json_2.1.1" / split, root / split):
        if candidate.is_dir():
            return candidate
    if not root.is_dir():
        raise FileNotFoundError(f"alfworld: data directory {root} does not exist")
    return root


def game_walkthrough(game_path: str | os.PathLike) -> list[str]:
    """The expert plan ``alfworld-generate`` stored in a ``game.tw-pddl``."""
    import json

    return list(json.loads(Path(game_path).read_text())["walkthrough"])


def _copy_pddl_state(state: Any, downward_lib: Any, logic: Any) -> Any:
    """A copy of a ``PddlState`` whose fact containers are independent, bound to ``downward_lib``.

    The translated task, SAS text and action table are never written after construction and are shared.
    """
    new = copy.copy(state)
    new.downward_lib = downward_lib
    new._logic = logic
    new._facts = defaultdict(set, {name: set(facts) for name, facts in state._facts.items()})
    new._vars_by_name = dict(state._vars_by_name)
    new._vars_by_type = defaultdict(set, {name: set(vars_) for name, vars_ in state._vars_by_type.items()})
    new._var_counts = Counter(state._var_counts)
    if hasattr(state, "_operators"):
        new._operators = dict(state._operators)
    return new


def _copy_game_state(state: Any) -> Any:
    # a GameState's values are replaced, never mutated, by later steps, so a shallow copy is independent
    return None if state is None else type(state)(state)


@dataclasses.dataclass(frozen=True)
class _SasPayload:
    """What the SAS snapshot keeps (see the module docstring)."""

    game: str
    loaded: _LoadedGame
    operators: tuple[tuple[int, int], ...]  # (operator id, number of effect atoms) applied since reset
    pddl_state: Any
    game_state: Any
    prev_state: Any
    last_action: Any
    moves: int
    steps: int


class ALFWorldSandbox(Sandbox):
    """An ALFWorld game; see the module docstring for data layout, snapshot and reward."""

    @dataclasses.dataclass
    class Config:
        """Keys accepted under ``bpo.sandbox.config`` for ``name=alfworld``.

        Attributes:
            data_dir: root of the games (default None: ``$ALFWORLD_DATA``); see ``resolve_games_dir``.
            split: ``train``, ``valid_seen`` or ``valid_unseen`` (default ``train``) for ``{"task_id": i}`` tasks.
            task_types: ALFWorld task types kept for ``{"task_id": i}`` (default: all six).
            max_steps: turns after which the episode ends unwon, turns without a parseable command included
                (default 50, ALFWorld's usual budget).
            show_admissible: list the admissible commands in every observation (default True).
            snapshot: ``"sas"`` (reload the translated task + re-apply operators; default) or ``"replay"``.
        """

        data_dir: str | None = None
        split: str = "train"
        task_types: tuple[str, ...] = TASK_TYPES
        max_steps: int = 50
        show_admissible: bool = True
        snapshot: str = "sas"

        def __post_init__(self) -> None:
            if self.snapshot not in ("sas", "replay"):
                raise ValueError(f"alfworld: snapshot must be sas or replay, got {self.snapshot!r}")
            unknown = set(self.task_types) - set(TASK_TYPES)
            if unknown:
                raise ValueError(f"alfworld: unknown task types {sorted(unknown)}; choose from {TASK_TYPES}")
            if self.max_steps < 1:
                raise ValueError("alfworld: max_steps must be >= 1")
            self.task_types = tuple(self.task_types)
            self.data_dir = _absolute(self.data_dir)  # see ALFWorldSandbox.__init__

    # Concurrent resets on different instances corrupt TextWorld's shared grammar parser (seen in threads).
    thread_safe: ClassVar[bool] = False
    # So the tree sampler runs these sandboxes in engine processes of their own (verl_bpo.rollout.engine_pool):
    # concurrent trees step in parallel. This needs an un-reset sandbox to pickle (it holds only its config) and
    # the chat rendering to depend on the config and the observation alone.
    engine_process: ClassVar[bool] = True
    name: ClassVar[str] = "alfworld"
    deterministic: ClassVar[bool] = True

    def __init__(self, config: ALFWorldSandbox.Config | None = None) -> None:
        super().__init__()
        self.config = config or ALFWorldSandbox.Config()
        # Relative paths (data_dir, $ALFWORLD_DATA, a task's game without a data_dir) are the ones of where the
        # sandbox is made, not of the private directory of the engine process it may be shipped to
        # (verl_bpo.rollout.engine_pool): resolved now.
        self._origin = os.getcwd()
        self._data_dir = _absolute(self.config.data_dir or os.environ.get("ALFWORLD_DATA"))
        self.snapshot_kind = SnapshotKind.REPLAY if self.config.snapshot == "replay" else SnapshotKind.NATIVE
        self._engine: Any = None  # the TextWorld batch gym env
        self._game: str | None = None
        self._games: list[Path] | None = None
        self._operators: list[tuple[int, int]] = []
        self._steps = 0
        self._admissible: list[str] = []
        self._running = 0  # engine calls in flight; close() during one drops the engine instead of recycling it

    # --- games ----------------------------------------------------------------------------------------------
    def games(self) -> list[Path]:
        """The games ``{"task_id": i}`` indexes."""
        if self._games is None:
            root = resolve_games_dir(self._data_dir, self.config.split)
            self._games = find_games(root, self.config.task_types)
        return self._games

    def resolve_game(self, task: Mapping[str, Any]) -> str:
        if "game" in task:
            path = Path(task["game"])
            if not path.is_absolute():
                path = Path(self.config.data_dir or self._origin) / path
        elif "task_id" in task:
            games = self.games()
            if not 0 <= int(task["task_id"]) < len(games):
                raise ValueError(f"alfworld: task_id {task['task_id']} out of range, {len(games)} games found")
            path = games[int(task["task_id"])]
        else:
            raise ValueError(f"alfworld: a task needs 'game' or 'task_id', got {dict(task)}")
        if not path.is_file():
            raise FileNotFoundError(f"alfworld: no game file at {path}")
        return str(path.resolve())

    # --- engine ---------------------------------------------------------------------------------------------
    def _ensure_engine(self, game: str) -> None:
        """An engine for this sandbox: its own, an idle one (holding ``game`` if possible) or a new one."""
        if self._engine is None:
            self._engine = _take_idle_engine(game)
            self._game = getattr(self._engine, "_bpo_game", None)
        if self._engine is None:
            import textworld
            import textworld.gym
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

            infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
            with _INFOS_LOCK:  # the gym registry is process-global
                env_id = textworld.gym.register_games(
                    [game], infos, batch_size=1, asynchronous=False, max_episode_steps=None,
                    wrappers=[AlfredDemangler(shuffle=False), AlfredInfos],
                )  # fmt: skip
            self._engine = textworld.gym.make(env_id)  # no game is loaded (nor translated) until reset/attach
            self._game = None

    def _start_game(self, game: str) -> tuple[tuple[str, ...], dict[str, list[Any]]]:
        """Point the engine at ``game`` and reset it (the way verl-agent's AlfredTWEnv builds it)."""
        self._ensure_engine(game)
        # the gym env cycles through its game list; a one-game list makes reset() load exactly this game
        self._engine.gamefiles = [game]
        self._engine.seed(0)
        self._game = None
        obs, infos = self._engine.reset()
        self._set_game(game)
        return obs, infos

    def _set_game(self, game: str | None) -> None:
        self._game = game
        self._engine._bpo_game = game

    def _attach_game(self, game: str, loaded: _LoadedGame) -> None:
        """Make the engine hold ``game`` from its loaded parts (what ``PddlEnv.load`` builds), without the PDDL
        translation; the state is set by the caller."""
        from alfworld.agents.environment.alfred_tw_env import AlfredInfos
        from textworld.envs.pddl import PddlEnv
        from textworld.envs.wrappers import GenericEnvironment

        chain = _wrapper_chain(self._engine)
        generic = next(layer for layer in chain if isinstance(layer, GenericEnvironment))
        pddl = generic.__dict__.get("_wrapped_env")
        if not isinstance(pddl, PddlEnv):  # an engine that never loaded a game: give it its planner library
            pddl = PddlEnv(generic.request_infos)
            generic._wrap(pddl)
            generic._last_backend = PddlEnv
        pddl._game_file = game
        pddl._game_data, pddl.walkthrough = loaded.game_data, loaded.walkthrough
        pddl._logic, pddl._entity_infos = loaded.logic, loaded.entity_infos
        for layer in chain:
            if isinstance(layer, AlfredInfos):
                layer._gamefile = game
        self._engine.gamefiles = [game]
        self._set_game(game)

    @property
    def _pddl(self) -> Any:
        """The engine's ``PddlEnv`` (innermost layer of the wrapper stack)."""
        return self._engine.batch_env.envs[0].unwrapped

    def _reset(self, task: Mapping[str, Any]) -> Observation:
        game = self.resolve_game(task)
        try:
            with self._engine_call():
                obs, infos = self._start_game(game)
        except Exception as exc:
            self._discard_engine()
            raise SandboxCrashed(f"alfworld: reset of {game} failed: {exc!r}") from exc
        self._operators = []
        self._steps = 0
        self._admissible = list(infos["admissible_commands"][0])
        return Observation(self._render(obs[0], self._admissible, False), self._info(infos, False))

    def parse_action(self, text: str) -> str | None:
        return parse_text_command(text, (_ACTION_TAG, ACTION_LINE))

    def _step_text(self, action_text: str) -> StepResult:
        if self.parse_action(action_text) is not None:
            return super()._step_text(action_text)
        # a turn without a command counts towards max_steps too, so a model that never acts still ends
        result = super()._step_text(action_text)
        self._steps += 1
        return self._end_at_step_limit(result, self._steps, self.config.max_steps)

    def _apply(self, action: str) -> StepResult:
        invalid = action not in self._admissible
        try:
            # the step replaces the operator table with the next state's; keep the one the action comes from
            operators = self._pddl._pddl_state._operators
            with self._engine_call():
                obs, scores, dones, infos = self._engine.step([action])
            applied = self._pddl._last_action
            if applied is not None:
                op = operators[applied.id]
                self._operators.append((int(op.id), int(op.nb_effect_atoms)))
        except Exception as exc:
            self._discard_engine()
            raise SandboxCrashed(f"alfworld: step {action!r} failed: {exc!r}") from exc
        self._steps += 1
        won = bool(infos["won"][0])
        truncated = not won and self._steps >= self.config.max_steps
        self._admissible = list(infos["admissible_commands"][0])
        info = {**self._info(infos, won), "invalid_action": invalid}
        if truncated:
            info["truncated"] = True
        observation = Observation(self._render(obs[0], self._admissible, won), info)
        return StepResult(observation, 1.0 if won else 0.0, won or truncated, info)

    def _render(self, text: str, admissible: list[str], won: bool) -> str:
        text = text.strip()
        if self.config.show_admissible and not won:
            text += "\nAdmissible commands: " + ", ".join(admissible) + "."
        return text

    @staticmethod
    def _info(infos: Mapping[str, list[Any]], won: bool) -> dict[str, Any]:
        return {
            "won": won,
            "admissible_commands": list(infos["admissible_commands"][0]),
            "gamefile": infos["extra.gamefile"][0] if "extra.gamefile" in infos else None,
        }

    # --- snapshots ------------------------------------------------------------------------------------------
    def _snapshot_payload(self) -> Any:
        pddl = self._pddl
        return _SasPayload(
            game=self._game,
            loaded=_LoadedGame(pddl._game_data, pddl.walkthrough, pddl._logic, pddl._entity_infos),
            operators=tuple(self._operators),
            pddl_state=_copy_pddl_state(pddl._pddl_state, pddl.downward_lib, pddl._logic),
            game_state=_copy_game_state(pddl.state),
            prev_state=_copy_game_state(pddl.prev_state),
            last_action=pddl._last_action,
            moves=pddl._moves,
            steps=self._steps,
        )

    def _restore_payload(self, snapshot: Snapshot) -> None:
        if self.config.snapshot == "replay" or snapshot.kind is SnapshotKind.REPLAY:
            super()._restore_payload(snapshot)
            return
        payload = snapshot.payload
        if not isinstance(payload, _SasPayload):
            raise RestoreFailed(f"alfworld: not an ALFWorld snapshot payload: {type(payload).__name__}")
        try:
            with self._engine_call():
                self._restore_sas(payload)
        except Exception:
            self._discard_engine()  # half-restored: never hand this engine to another sandbox
            raise

    def _restore_sas(self, payload: _SasPayload) -> None:
        self._ensure_engine(payload.game)
        if self._game != payload.game:
            if not os.path.isfile(payload.game):
                raise FileNotFoundError(f"alfworld: no game file at {payload.game}")
            self._attach_game(payload.game, payload.loaded)
        import fast_downward

        pddl = self._pddl
        lib = pddl.downward_lib
        lib.load_sas(payload.pddl_state.sas.encode("utf-8"))
        lib.load_sas_replan(payload.pddl_state.sas_replan.encode("utf-8"))
        for op_id, nb_effects in payload.operators:
            lib.apply_operator(op_id, (fast_downward.Atom * nb_effects)())
        pddl._pddl_state = _copy_pddl_state(payload.pddl_state, lib, pddl._logic)
        pddl.state = _copy_game_state(payload.game_state)
        pddl.prev_state = _copy_game_state(payload.prev_state)
        pddl._last_action = payload.last_action
        pddl._moves = payload.moves
        # the batch layer replays its last result once a game ended; a restored game has not ended
        self._engine.batch_env.last = [None]
        self._operators = list(payload.operators)
        self._steps = payload.steps
        self._admissible = list(payload.game_state["admissible_commands"])

    # --- lifecycle ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _engine_call(self) -> Iterator[None]:
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1

    def _discard_engine(self) -> None:
        """Drop an engine in an unknown state instead of recycling it; a later reset or restore starts another."""
        self._engine = None
        self._game = None

    def close(self) -> None:
        engine, self._engine, self._game = self._engine, None, None
        if engine is None or self._running:  # a call still runs on it: never hand it to another sandbox
            return
        with _IDLE_LOCK:
            _IDLE_ENGINES.append(engine)

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return (
            "You are a household robot in a text environment. Each turn, reply with exactly one admissible "
            "command, e.g. 'go to countertop 1' or 'take apple 1 from countertop 1'. Write it alone or on a line "
            "'action: <command>'."
        )
