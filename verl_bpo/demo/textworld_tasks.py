"""The real-engine task pair of the learning benchmark: generated TextWorld games, the decision late or early.

``real_late``  — a fixed set of ``tw-make custom`` games (world size 4, 8 objects, quests of 8 steps: fetch a key from
                 a container, unlock, open, carry, put ...), played on the real engine
                 (:class:`sandbox_adapters.textworld.TextWorldSandbox`) with its own observations: the objective
                 text, room descriptions and feedback, and the admissible commands listed. An episode has exactly as
                 many turns as the walkthrough (``max_steps`` = 8), so every command must be the quest's next one;
                 a game is won (reward 1) only along its walkthrough. The warm start imitates the walkthrough (the
                 engine's own expert plan) with noise: at the *decisive* step, the walkthrough's **last**, the
                 demonstrator picks uniformly among the listed commands, and elsewhere a small share of its commands
                 are random ones (``noise``). A fresh policy so plays the routine well and guesses the final
                 command, and RL has to learn it: which command that is, the objective of the first observation
                 says in its last sentence, and the listed commands contain it.
``real_early`` — the same games, engine, settings and warm start with the decisive step the walkthrough's **first**:
                 the first command decides and the routine after it only reveals the outcome.

Games are generated as part of building the task (:func:`build_games`, deterministic by seed, cached under the
benchmark's output directory); the tiny model's tokenizer is trained on this engine's chats and its warm start on
the demonstrator's (:func:`textworld_task_model`). A task's ``sandbox_config`` names no ``games_dir`` until
:func:`with_games` gives it the cache directory.

Observations are the engine's, every admissible command listed; only the ASCII-art title of the first turn is
stripped (``strip_banner``: a hundred tokens that carry nothing). A few generated games cannot be won along their
walkthrough on this engine; :func:`build_games` skips them.

Not yet in :data:`verl_bpo.demo.tasks.TASKS` (the learning benchmark does not run them). Calibration status: ``target``, ``lr``, ``batch`` and ``updates`` are not calibrated yet. On 32 of these games (24
train, 8 held out), a 120-step warm start (loss 1.04) won no episode (0/16 held out, 0/48 training games): the
tiny model does not yet follow the walkthroughs. Episodes take ~340 prompt and ~810 (at most ~1140) response tokens,
and commands up to 11 tokens, so the benchmark needs ``response_length`` >= 1536 and ``max_tokens_per_turn`` >= 12.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_adapters.textworld import TextWorldSandbox, game_walkthrough, make_games
from verl_bpo.demo.tasks import DemoTask
from verl_bpo.demo.tiny_model import build_tiny_model, default_corpus
from verl_bpo.demo.warm_start import play_chats, random_policy_chats, warm_start

__all__ = ["GAME_SETTINGS", "N_GAMES", "TEXTWORLD_TASKS", "real_late", "real_early", "games_dir", "build_games",
           "with_games", "decisive_step", "demonstrator_action", "demonstration_chats", "textworld_task_model"]

GAME_SETTINGS = {"world_size": 4, "nb_objects": 8, "quest_length": 8}
N_GAMES = 64  # 48 train, 16 held out; task ids index the games in sorted file order
SEED_CHUNK = 8  # seeds are generated in chunks of this many until N_GAMES of them are playable
VOCAB_SIZE = 1024  # the tokenizer's BPE budget: every word of these games' commands becomes one token
_SANDBOX_CONFIG = {"max_steps": GAME_SETTINGS["quest_length"], "show_admissible": True, "strip_banner": True}

real_late = DemoTask(
    "real_late", "textworld", _SANDBOX_CONFIG, train_ids=range(0, 48), eval_ids=range(48, 64),
    max_turns=GAME_SETTINGS["quest_length"],
    warm_start={"decisive": "last", "noise": 0.03, "episodes": 192, "steps": 300, "batch_size": 8, "lr": 3e-3},
    target=0.5, lr=1e-3, batch=2, updates=32)
# Derived from ``real_late`` so that the two tasks differ, by construction, only in where the decision sits.
real_early = dataclasses.replace(real_late, name="real_early",
                                 warm_start={**real_late.warm_start, "decisive": "first"})
TEXTWORLD_TASKS = {task.name: task for task in (real_late, real_early)}


def games_dir(out: str | Path) -> Path:
    """Where the tasks' games are cached under the benchmark's output directory ``out`` (only these games: task
    ids index the directory's ``.z8`` files)."""
    settings = "_".join(f"{key[0]}{value}" for key, value in GAME_SETTINGS.items())
    return Path(out) / f"textworld_games_{settings}_n{N_GAMES}"


def playable(game: str | Path) -> bool:
    """Whether the game's walkthrough wins it on the tasks' sandbox within the step budget. A few generated games
    do not: the engine's parser misreads some possessive names ("unlock Henderson's limited edition chest with
    Henderson's limited edition keycard")."""
    box = TextWorldSandbox(TextWorldSandbox.Config(**_SANDBOX_CONFIG))
    try:
        box.reset({"game": str(Path(game).resolve())})
        for action in game_walkthrough(game):
            result = box.step(action)
            if result.done:
                return bool(result.info.get("won"))
        return False
    finally:
        box.close()


def build_games(out: str | Path, workers: int = 2) -> Path:
    """Generate the games and return their directory (cached; deterministic).

    Seeds 0, 1, 2, ... are generated with ``tw-make`` (about 5 s a game, ``workers`` at a time) into ``all/`` in
    chunks, and the first :data:`N_GAMES` :func:`playable` ones in seed order are copied into the directory the
    tasks index."""
    path = games_dir(out)
    pool = path / "all"
    chosen = sorted(path.glob("*.z8"))
    if len(chosen) == N_GAMES and all(g.with_suffix(".json").is_file() for g in chosen):
        return path
    for stale in [*path.glob("*.z8"), *path.glob("*.json")]:
        stale.unlink()
    games: list[Path] = []
    start = 0
    while len(games) < N_GAMES:
        made = make_games(pool, range(start, start + SEED_CHUNK), workers=workers, **GAME_SETTINGS)
        games += [g for g in made if playable(g)]
        start += SEED_CHUNK
    for game in games[:N_GAMES]:
        for src in (game, game.with_suffix(".json")):
            shutil.copyfile(src, path / src.name)
    return path


def with_games(task: DemoTask, out: str | Path) -> DemoTask:
    """``task`` with its sandbox config naming the games cached under ``out`` (absolute path)."""
    return dataclasses.replace(task, sandbox_config={**task.sandbox_config,
                                                     "games_dir": str(games_dir(out).resolve())})


def decisive_step(walkthrough_length: int, decisive: str) -> int:
    """The index of the walkthrough step where the demonstrator guesses: ``last`` or ``first``."""
    if decisive not in ("last", "first"):
        raise ValueError(f"decisive must be 'last' or 'first', got {decisive!r}")
    return walkthrough_length - 1 if decisive == "last" else 0


def demonstrator_action(turn: int, walkthrough: Sequence[str], admissible: Sequence[str], rng: random.Random,
                        decisive: int, noise: float) -> str:
    """The warm start's command at ``turn``: uniform among the ``admissible`` commands at the ``decisive`` step
    and with probability ``noise`` elsewhere; otherwise the walkthrough's (uniform too when the walkthrough has
    ended or its command is not admissible, after an earlier deviation)."""
    guess = turn == decisive or rng.random() < noise
    if not guess and turn < len(walkthrough) and walkthrough[turn].lower() in {c.lower() for c in admissible}:
        return walkthrough[turn]
    return rng.choice(list(admissible))


def demonstration_chats(task: DemoTask, episodes: int | None = None, seed: int = 0,
                        ids: Sequence[int] | None = None) -> list[list[dict[str, str]]]:
    """The demonstrator's chats on ``task``'s training games (``task`` must name its games, :func:`with_games`)."""
    settings = task.warm_start
    episodes = settings["episodes"] if episodes is None else episodes
    ids = list(task.train_ids if ids is None else ids)
    rng = random.Random(seed)
    box = TextWorldSandbox(TextWorldSandbox.Config(**task.sandbox_config))

    def policy(game_task: Mapping[str, Any]):
        walkthrough = game_walkthrough(box.resolve_game(game_task))
        decisive = decisive_step(len(walkthrough), settings["decisive"])
        return lambda turn, obs: demonstrator_action(turn, walkthrough, obs.info["admissible_commands"], rng,
                                                     decisive, settings["noise"])

    return play_chats(box, [{"task_id": i} for i in ids], episodes, task.max_turns, policy)


def _corpus(out: Path) -> list[str]:
    """The tokenizer's corpus: the default lines and this engine's chats (demonstrator and random policy) on the
    training games of both tasks."""
    lines = default_corpus()
    for task in TEXTWORLD_TASKS.values():
        task = with_games(task, out)
        chats = demonstration_chats(task, episodes=2 * len(task.train_ids), seed=1)
        chats += random_policy_chats(task.sandbox, task.sandbox_config, task.tasks(task.train_ids),
                                     len(task.train_ids), task.max_turns, seed=1)
        lines += [m["content"] for chat in chats for m in chat]
    return lines


def textworld_task_model(out: str | Path, task: DemoTask) -> Path:
    """The tiny model warm-started on ``task`` (cached under ``out``; the games are generated first when missing).
    One tokenizer for both real tasks, trained on this engine's chats (its own directory, ``tiny_textworld``)."""
    out = Path(out)
    build_games(out)
    tiny = build_tiny_model(out / "tiny_textworld", corpus=_corpus(out), vocab_size=VOCAB_SIZE)
    task = with_games(task, out)
    settings: Mapping[str, Any] = task.warm_start
    return warm_start(tiny, out / f"tiny_warm_{task.name}", task.sandbox, task.tasks(task.train_ids),
                      dict(task.sandbox_config), steps=settings["steps"], batch_size=settings["batch_size"],
                      lr=settings["lr"], chats=demonstration_chats(task), max_turns=task.max_turns,
                      episodes=settings["episodes"])
