"""The real-engine tasks of the learning benchmark: generated TextWorld games, the decision late or early.

``real_late``  — a fixed set of ``tw-coin_collector`` games of level 8 (a chain of eight rooms without dead ends:
                 seven moves, then "take coin" in the last room), played on the real engine
                 (:class:`sandbox_adapters.textworld.TextWorldSandbox`) with its own observations: the objective
                 text, each room's description and its exits in the engine's varied phrasing, and the admissible
                 commands listed. An episode has ``max_steps`` = 8 turns, the walkthrough's 8 and no slack, so one
                 wrong or wasted command costs the game (reward 1 for the coin). The warm start imitates the
                 walkthrough (the engine's own expert plan) with noise: at the *decisive* step, the walkthrough's
                 **last** ("take coin" among "examine coin", "look", "inventory" and the exits), the demonstrator
                 picks uniformly among the listed commands, and elsewhere a small share of its commands are random
                 ones (``noise``). A fresh policy walks the chain (leaving each room by the exit it did not come in
                 by, which the observation and the previous command tell) and guesses in the last room, and RL has to
                 learn the last command, which the observation shows ("There is a coin on the floor").
``real_early`` — the same games, engine, settings and warm start with the decisive step the walkthrough's **first**
                 (the first room's one exit among "look" and "inventory"): the first command decides and the walk
                 after it only reveals the outcome.
``real_late_exit`` — ``real_late`` on its first :data:`N_EXIT_GAMES` games with the decisive step the walkthrough's
                 **next-to-last**, the move out of the seventh room (two exits, "look" and "inventory" listed): a
                 decision read from the observation (the exit not come in by) whose command differs between games,
                 where ``real_late``'s "take coin" is the same in every game, so that an update's successes need not
                 point the same way. Its early twin is ``real_early`` (a move as well, the first; on all 64 games).

Games are generated as part of building the task (:func:`build_games`, deterministic by seed, cached under the
benchmark's output directory). **Evaluation plays the training games** (``eval_ids`` = ``train_ids``), in sampled
episodes of their own (never an update's rollouts, the same games and sandbox seeds for every estimator): the warm start
learns each training game's route, not a rule that carries it through games it never saw (measured below), so on unseen
chains every estimator would read zero. What RL has to learn, the decisive command, is the same kind of command in every
game ("take coin" last; the first room's one exit first; the seventh room's onward exit). The tiny model's tokenizer is
trained on this engine's chats and its warm start on the demonstrator's (:func:`textworld_task_model`). A task's
``sandbox_config`` names no ``games_dir`` until :func:`with_games` gives it the cache directory. Observations are the
engine's, every admissible command listed; only the ASCII-art title of the first turn is stripped (``strip_banner``: a
hundred tokens that carry nothing). Episodes take about 236 prompt and 580 response tokens.

Why coin collector (measured, ``real_late``'s sampled episodes, temperature 1): the earlier games of this pair were
``tw-make custom`` quests (one room, 5 objects, quests of 5 steps: take a key, unlock a container, ...), where the
routine is each game's object names. A chain of rooms has a routine that could hold in every game (take the listed
exit you did not come in by), and one decisive command that does.

Why the training games (2026-12-06, warm starts of 1000 steps, batch 8, lr 3e-3 decaying to 0, 256 demonstrations;
teacher-forced probability of the seven moves on 16 unseen games, and the success of 128 sampled episodes on unseen
and on training games): a rule that carries to unseen chains was found, partly, by 3 of 11 warm starts (0.07,
0.03 and 0.03 success on unseen games, the others 0.00), whatever was tried: the recipe on 64 games, four draws (0.07,
0.00, 0.00, 0.00); 2000 steps, two draws (0.00, 0.03); 192 training games with 256 or 1024 demonstrations (0.00,
0.00: the moves at chance between the room's two exits, or below); a model of 4 layers (64 games: 0.00, the moves at
0.32-0.59 on unseen games while its loss fell to that of a memorized route; 192 games and 768 demonstrations: 0.03,
0.00); a model of width 256 (its loss stayed at the chance level of the moves for 450 steps; stopped). Each of the
four warm starts on 64 games measured on its training games had learned their routes: sampled success 0.11, 0.125,
0.125 and 0.23 (the 4-layer one, the first one with the turn-indexed demonstrator, seeds 1 and 2 of the recipe),
sparse, with "take coin" at 0.11-0.2 in the last room, as the late form needs. Commands are one or two tokens; 128
sampled episodes take about 13 s.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_adapters.textworld import TextWorldSandbox, game_walkthrough, make_games
from verl_bpo.demo.tasks import DemoTask, warm_start_folder
from verl_bpo.demo.tiny_model import build_tiny_model, default_corpus
from verl_bpo.demo.warm_start import play_chats, random_policy_chats, warm_start

__all__ = ["CHALLENGE", "GAME_SETTINGS", "DECISIVE_STEPS", "QUEST_LENGTH", "N_TRAIN", "MAX_STEPS",
           "TEXTWORLD_TASKS", "real_late", "real_early", "real_late_exit", "N_EXIT_GAMES", "games_dir", "build_games",
           "with_games", "decisive_step", "demonstrator_action", "demonstration_chats", "textworld_task_model"]

CHALLENGE = "tw-coin_collector"
GAME_SETTINGS = {"level": 8}  # a chain of 8 rooms, no dead ends: 7 moves and "take coin"
QUEST_LENGTH = GAME_SETTINGS["level"]  # the walkthrough's commands: at levels 1-100, the chain's length
N_TRAIN = 64  # the games: task ids index them in sorted file order
MAX_STEPS = QUEST_LENGTH  # the turns of an episode: no slack, so one wrong command costs the game
DECISIVE_STEPS = {"last": -1, "next_to_last": -2, "first": 0}  # the walkthrough's step, from its end when negative
SEED_CHUNK = 8  # seeds are generated in chunks of this many until enough games are chosen
VOCAB_SIZE = 1024  # the tokenizer's BPE budget: every word of these games' commands becomes one token
_SANDBOX_CONFIG = {"max_steps": MAX_STEPS, "show_admissible": True, "strip_banner": True}

# Calibrated on one RLOO seed (2026-12-06, warm start 0, evaluation every 4 updates): RLOO reached the target 0.5 at
# update 12 (0.07 at the warm start, 0.59-0.73 from there to update 32), RLOO-2N at 8; so 24 updates. Evaluation plays
# the training games (module docstring).
real_late = DemoTask(
    "real_late", "textworld", _SANDBOX_CONFIG, train_ids=range(0, N_TRAIN), eval_ids=range(0, N_TRAIN),
    max_turns=MAX_STEPS,
    warm_start={"decisive": "last", "noise": 0.03, "episodes": 256, "steps": 1000, "batch_size": 8, "lr": 3e-3,
                "decay": True},
    target=0.5, lr=1e-3, batch=2, updates=24, vocabulary="textworld", response_length=768)
# Derived from ``real_late`` so that the two tasks differ, by construction, only in where the decision sits.
real_early = dataclasses.replace(real_late, name="real_early",
                                 warm_start={**real_late.warm_start, "decisive": "first"})
# The decision read from the observation and different in every game: which of the seventh room's exits leads on.
# Fewer games, so that each recurs three times in 24 updates of two and a game's own decision can be learned from its
# rollouts. Not calibrated before its control ran (README).
N_EXIT_GAMES = 16
_EXIT_IDS = range(N_EXIT_GAMES)  # evaluation plays the training games, as real_late's does
real_late_exit = dataclasses.replace(real_late, name="real_late_exit", train_ids=_EXIT_IDS, eval_ids=_EXIT_IDS,
                                     warm_start={**real_late.warm_start, "decisive": "next_to_last"})
TEXTWORLD_TASKS = {task.name: task for task in (real_late, real_early, real_late_exit)}


def games_dir(out: str | Path) -> Path:
    """Where the tasks' games are cached under the benchmark's output directory ``out`` (only these games: task
    ids index the directory's ``.z8`` files)."""
    settings = "_".join(f"{key[0]}{value}" for key, value in GAME_SETTINGS.items())
    return Path(out) / f"textworld_games_{CHALLENGE}_{settings}_t{N_TRAIN}"


def playable(game: str | Path) -> bool:
    """Whether the game's walkthrough wins it on the tasks' sandbox within the step budget (a guard: some
    ``custom`` games do not, where the engine's parser misreads a possessive name)."""
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

    Seeds 0, 1, 2, ... are generated with ``tw-make`` (about 3 s a game, ``workers`` at a time; 96 games took 156 s)
    into ``all/`` in chunks. In seed order, the first :data:`N_TRAIN` :func:`playable` games are copied into the
    directory the tasks index, named with their index first so that sorted file order is this order."""
    path = games_dir(out)
    pool = path / "all"
    chosen = sorted(path.glob("*.z8"))
    if len(chosen) == N_TRAIN and all(g.with_suffix(".json").is_file() for g in chosen):
        return path
    for stale in [*path.glob("*.z8"), *path.glob("*.json")]:
        stale.unlink()
    games: list[Path] = []
    start = 0
    while len(games) < N_TRAIN:
        made = make_games(pool, range(start, start + SEED_CHUNK), challenge=CHALLENGE, workers=workers,
                          **GAME_SETTINGS)
        games += list(filter(playable, made))[: N_TRAIN - len(games)]
        start += SEED_CHUNK
    for index, game in enumerate(games):
        for src in (game, game.with_suffix(".json")):
            shutil.copyfile(src, path / f"{index:03d}_{src.name}")
    return path


def with_games(task: DemoTask, out: str | Path) -> DemoTask:
    """``task`` with its sandbox config naming the games cached under ``out`` (absolute path)."""
    return dataclasses.replace(task, sandbox_config={**task.sandbox_config,
                                                     "games_dir": str(games_dir(out).resolve())})


def decisive_step(walkthrough_length: int, decisive: str) -> int:
    """The index of the walkthrough step where the demonstrator guesses: one of :data:`DECISIVE_STEPS`."""
    if decisive not in DECISIVE_STEPS:
        raise ValueError(f"decisive must be one of {sorted(DECISIVE_STEPS)}, got {decisive!r}")
    step = DECISIVE_STEPS[decisive]
    if not -walkthrough_length <= step < walkthrough_length:
        raise ValueError(f"a walkthrough of {walkthrough_length} commands has no {decisive} step to decide")
    return step % walkthrough_length


def demonstrator_action(turn: int, played: int, walkthrough: Sequence[str], admissible: Sequence[str],
                        rng: random.Random, decisive: int, noise: float) -> str:
    """The warm start's command at ``turn``, ``played`` of the walkthrough's commands done so far in order: uniform
    among the ``admissible`` commands at the ``decisive`` turn and with probability ``noise`` elsewhere; otherwise
    the walkthrough's next command (uniform too when the walkthrough has ended or its next command is not
    admissible, after a wrong move). Counting by ``played``, not ``turn``, keeps a demonstration on the walkthrough
    after a wrong guess that does not move ("look" in the first room): the turns after it teach the routine, as
    in the late form, and the lost turn alone costs the game."""
    guess = turn == decisive or rng.random() < noise
    if not guess and played < len(walkthrough) and walkthrough[played].lower() in {c.lower() for c in admissible}:
        return walkthrough[played]
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
        played = 0

        def act(turn: int, obs: Any) -> str:
            nonlocal played
            action = demonstrator_action(turn, played, walkthrough, obs.info["admissible_commands"], rng, decisive,
                                         settings["noise"])
            played += played < len(walkthrough) and action.lower() == walkthrough[played].lower()
            return action

        return act

    return play_chats(box, [{"task_id": i} for i in ids], episodes, task.max_turns, policy)


def _corpus(out: Path) -> list[str]:
    """The tokenizer's corpus: the default lines and this engine's chats (demonstrator and random policy) on the
    training games of ``real_late`` and ``real_early`` (``real_late_exit`` plays some of the same games, so the
    tokenizer and its cache stay as they were before it)."""
    lines = default_corpus()
    for task in (real_late, real_early):
        task = with_games(task, out)
        chats = demonstration_chats(task, episodes=2 * len(task.train_ids), seed=1)
        chats += random_policy_chats(task.sandbox, task.sandbox_config, task.tasks(task.train_ids),
                                     len(task.train_ids), task.max_turns, seed=1)
        lines += [m["content"] for chat in chats for m in chat]
    return lines


def textworld_task_model(out: str | Path, task: DemoTask, seed: int = 0) -> Path:
    """The tiny model warm-started on ``task`` (cached under ``out``; the games are generated first when missing).
    One tokenizer for every real-engine task, trained on this engine's chats (:func:`_corpus`; its own directory,
    ``tiny_textworld``).
    ``seed`` draws the demonstrations and the batch order, as for :func:`verl_bpo.demo.tasks.task_model`."""
    out = Path(out)
    build_games(out)
    tiny = build_tiny_model(out / f"tiny_{task.vocabulary}", corpus=_corpus(out), vocab_size=VOCAB_SIZE)
    task = with_games(task, out)
    settings: Mapping[str, Any] = task.warm_start
    return warm_start(tiny, out / warm_start_folder(task, seed), task.sandbox, task.tasks(task.train_ids),
                      dict(task.sandbox_config), steps=settings["steps"], batch_size=settings["batch_size"],
                      lr=settings["lr"], chats=demonstration_chats(task, seed=seed), max_turns=task.max_turns,
                      episodes=settings["episodes"], decay=settings.get("decay", False), seed=seed)
