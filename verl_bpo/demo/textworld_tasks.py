"""The real-engine task pair of the learning benchmark: generated TextWorld games, the decision late or early.

``real_late``  — a fixed set of ``tw-make custom`` games (one room, 5 objects, quests of 5 steps: take a key, unlock
                 a container, open it, take what it holds, drop, eat, put or insert it ...), played on the real engine
                 (:class:`sandbox_adapters.textworld.TextWorldSandbox`) with its own observations: the objective
                 text, the room's description and feedback, and the admissible commands listed. An episode has
                 ``max_steps`` = 8 turns, the quest's 5 and 3 of slack; a game is won (reward 1) when the quest is
                 done within them. The warm start imitates the walkthrough (the engine's own expert plan) with
                 noise: at the *decisive* step, the walkthrough's **last**, the demonstrator picks uniformly among
                 the listed commands (and keeps picking so in the turns of slack after a wrong guess), and elsewhere
                 a small share of its commands are random ones (``noise``). The intent: a fresh policy plays the
                 routine well and guesses the final command, and RL has to learn it (which command that is, the
                 objective of the first observation says in its last sentence, and the listed commands contain it).
``real_early`` — the same games, engine, settings and warm start with the decisive step the walkthrough's **first**:
                 the first command decides and the routine after it only reveals the outcome.

Games are generated as part of building the task (:func:`build_games`, deterministic by seed, cached under the
benchmark's output directory); the held-out games are distinct from the training games but use only their command
words (:func:`covered`). The tiny model's tokenizer is trained on this engine's chats and its warm start on the
demonstrator's (:func:`textworld_task_model`). A task's ``sandbox_config`` names no ``games_dir`` until
:func:`with_games` gives it the cache directory.

Observations are the engine's, every admissible command listed; only the ASCII-art title of the first turn is
stripped (``strip_banner``: a hundred tokens that carry nothing). A few generated games cannot be won along their
walkthrough on this engine; :func:`build_games` skips them.

Not in :data:`verl_bpo.demo.tasks.TASKS`: the warm start does not generalize to held-out games, so ``target``,
``lr``, ``batch`` and ``updates`` are not calibrated. Measured on ``real_late`` with LocalRL's sampled episodes
(flat groups, as ``LocalRL.evaluate``; temperature 1, ``max_tokens_per_turn`` 16):

* world size 4, 8 objects, quests of 8 steps, no slack; 24 training games, 8 held out; 120 warm-start steps (loss
  1.04): 0/32 held-out episodes won, 0/48 on training games; the routine is not learned even on training games
  (teacher-forced greedy accuracy of the walkthrough's commands 0-0.33 per turn).
* these settings, 48 training games (seeds 0-5 and 10-51: the first 48 file names of seeds 0-63, the split before
  :func:`covered`), 16 held out; 300 steps (lr 3e-3, batch 8, loss 0.86): 0/128 held out, 0/64 on training games.
* these settings, 600 steps (300 more from it, fresh optimizer, loss 0.38): the training games' routine is learned
  (greedy accuracy 0.94, 0.94, 1.0, 0.75 on steps 1-4), 1/64 sampled episodes won on training games, and 0/112 on
  the 14 games of seeds 6-9 and 52-87 whose command words all occur in the training games. On those the
  walkthrough's commands keep a log-prob of -17 to -26 each (-0.3 to -1.3 on training games): the model writes the
  training games' object names, it memorizes walkthroughs rather than copying from the listed commands.

So the pair needs a policy that copies from its observation (more distinct training games than it can memorize, or
a larger model) before RL has a warm start that plays the routine on held-out games. Episodes take ~950 tokens
(prompt and response) and commands up to 12 tokens; a warm-start step costs 2.5-5 s on two busy cores (600 steps
took 37 min), 128 sampled evaluation episodes ~50 s and one RLOO update of 2 x 8 episodes ~8 s.
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

__all__ = ["GAME_SETTINGS", "N_TRAIN", "N_EVAL", "N_GAMES", "MAX_STEPS", "TEXTWORLD_TASKS", "real_late", "real_early",
           "games_dir", "command_words", "covered", "build_games", "with_games", "decisive_step", "demonstrator_action",
           "demonstration_chats", "textworld_task_model"]

GAME_SETTINGS = {"world_size": 1, "nb_objects": 5, "quest_length": 5}
N_TRAIN, N_EVAL = 48, 16  # training and held-out games; task ids index the games in sorted file order
N_GAMES = N_TRAIN + N_EVAL
MAX_STEPS = 8  # the turns of an episode: the quest's 5 steps and 3 of slack
SEED_CHUNK = 8  # seeds are generated in chunks of this many until enough games are chosen
VOCAB_SIZE = 1024  # the tokenizer's BPE budget: every word of these games' commands becomes one token
_SANDBOX_CONFIG = {"max_steps": MAX_STEPS, "show_admissible": True, "strip_banner": True}

real_late = DemoTask(
    "real_late", "textworld", _SANDBOX_CONFIG, train_ids=range(0, N_TRAIN), eval_ids=range(N_TRAIN, N_GAMES),
    max_turns=MAX_STEPS,
    warm_start={"decisive": "last", "noise": 0.03, "episodes": 192, "steps": 600, "batch_size": 8, "lr": 3e-3},
    target=0.5, lr=1e-3, batch=2, updates=32)
# Derived from ``real_late`` so that the two tasks differ, by construction, only in where the decision sits.
real_early = dataclasses.replace(real_late, name="real_early",
                                 warm_start={**real_late.warm_start, "decisive": "first"})
TEXTWORLD_TASKS = {task.name: task for task in (real_late, real_early)}


def games_dir(out: str | Path) -> Path:
    """Where the tasks' games are cached under the benchmark's output directory ``out`` (only these games: task
    ids index the directory's ``.z8`` files)."""
    settings = "_".join(f"{key[0]}{value}" for key, value in GAME_SETTINGS.items())
    return Path(out) / f"textworld_games_{settings}_t{N_TRAIN}_e{N_EVAL}"


def command_words(walkthrough: Sequence[str]) -> set[str]:
    """The words of a walkthrough's commands (lower case)."""
    return {word for command in walkthrough for word in command.lower().split()}


def covered(walkthrough: Sequence[str], words: set[str]) -> bool:
    """Whether every word of ``walkthrough``'s commands is in ``words`` (the training games' command words).

    A held-out game must be: the tiny model's output layer is not tied to its input embeddings, so a token that is
    never a target in the warm start is only ever pushed down, and a command naming a new object ("whisk", "type 9
    latchkey") is out of its reach whatever RL does. Necessary, not sufficient (module docstring)."""
    return command_words(walkthrough) <= words


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
    chunks. In seed order, the first :data:`N_TRAIN` :func:`playable` games are the training games and the next
    :data:`N_EVAL` playable ones that are :func:`covered` by the training games' command words are the held-out
    games (about one in three is); they are copied into the directory the tasks index, named with their index first
    so that sorted file order is this order."""
    path = games_dir(out)
    pool = path / "all"
    chosen = sorted(path.glob("*.z8"))
    if len(chosen) == N_TRAIN + N_EVAL and all(g.with_suffix(".json").is_file() for g in chosen):
        return path
    for stale in [*path.glob("*.z8"), *path.glob("*.json")]:
        stale.unlink()
    train: list[Path] = []
    held_out: list[Path] = []
    words: set[str] = set()
    start = 0
    while len(train) < N_TRAIN or len(held_out) < N_EVAL:
        made = make_games(pool, range(start, start + SEED_CHUNK), workers=workers, **GAME_SETTINGS)
        for game in filter(playable, made):
            if len(train) < N_TRAIN:
                train.append(game)
                words |= command_words(game_walkthrough(game))
            elif len(held_out) < N_EVAL and covered(game_walkthrough(game), words):
                held_out.append(game)
        start += SEED_CHUNK
    for index, game in enumerate(train + held_out):
        for src in (game, game.with_suffix(".json")):
            shutil.copyfile(src, path / f"{index:03d}_{src.name}")
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
