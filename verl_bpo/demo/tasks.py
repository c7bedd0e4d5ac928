"""The embedded tasks of the CPU demo and the learning benchmark, and the tiny warm-started model for each.

``late``  — the signpost corridor (:mod:`sandbox_adapters.signpost`) of six rooms: walk east five times
            (routine), then open the right door (the red one, for every task); the outcome is decided by the last
            turn. The warm start walks well and picks doors at random, so a fresh policy succeeds a third to half
            of the time and RL has to learn the choice. (With the right door drawn per task the tiny model learns
            a color preference, not to read the sign, within the updates a 2-core box affords.)
``early`` — the same corridor with the choice first (``decide_at="start"``): open the right door, then walk its
            corridor of six rooms; the first turn decides and the walk only reveals it. Same warm start, learning
            rate and target, so the two tasks differ only in where the decision sits.
``hard_late`` / ``hard_early`` — the same pair made sparse: eight doors (red, blue, green, yellow, white, black,
            orange, purple; the green one right for every task, and the sign says so), a corridor of eight rooms
            (eleven turns) and two tasks per update. The warm start walks well and picks one door in eight, so a
            fresh policy succeeds about one episode in eight, and an update of 2 x 8 rollouts
            often sees one success or none. Calibrated with RLOO (2 seeds, lr 1e-3): the target 0.75 at 18-20
            updates; RLOO with 2N rollouts per task at 16-18, about 0.9 of RLOO's updates, so progress here is
            still mostly bound by the step. One task per update (8 rollouts) is noise-bound but unstable: RLOO
            collapsed to zero success on 3 of 3 seeds at lr 1e-3, and at lr 5e-4 it is step-bound again.
            (Drawn per task, so that the sign must be read, eight doors stayed at chance over 20 RLOO updates.)
            Their warm start decays its learning rate to 0: at a constant rate, six warm starts of the recipe on
            other draws (``task_model(..., seed=s)``) read 0.00-0.12 held-out on ``hard_late`` (one wrote "open
            green" without "door", which does not parse; one seldom opened a door); with the decay 0.10-0.20 (256
            episodes each, 2026-12-06).

Each task has training task ids and disjoint held-out evaluation ids. The tiny model's tokenizer is trained on its
pair's chats as well (``DemoTask.vocabulary``), so each action word (each door color included) is one token: a
policy-gradient step then moves whole actions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_bpo.demo.tiny_model import build_tiny_model, default_corpus
from verl_bpo.demo.warm_start import random_policy_chats, warm_start

__all__ = ["DemoTask", "TASKS", "task_model", "warm_start_folder"]


@dataclasses.dataclass(frozen=True)
class DemoTask:
    """One embedded task: its sandbox, its task ids, its warm start and the success that counts as learned.

    Attributes:
        name: ``late``, ``early``, ``hard_late`` or ``hard_early``.
        sandbox, sandbox_config: the registered sandbox and its ``Config`` keys.
        train_ids, eval_ids: task ids to train on and the ids evaluation plays, disjoint (the real-engine tasks' are
            their training games: :mod:`verl_bpo.demo.textworld_tasks` says why).
        max_turns: ``bpo.max_turns``.
        warm_start: keyword arguments of :func:`verl_bpo.demo.warm_start.warm_start`.
        target: the evaluation success that counts as reached (updates-to-target).
        lr: the learning rate every estimator trains this task with.
        batch: tasks per policy update (verl's ``data.train_batch_size``) in the learning benchmark.
        updates: policy updates per run in the learning benchmark.
        vocabulary: the tasks whose chats train one tokenizer (and so one tiny model): a pair shares one, so its two
            forms differ only in where the decision sits, and a new pair leaves the others' models as they were.
        response_length: verl's ``rollout.response_length`` in the learning benchmark: an episode's tokens after its
            prompt (actions and observations) that are trained. Default 384, enough for the corridors' episodes.
    """

    name: str
    sandbox: str
    sandbox_config: Mapping[str, Any]
    train_ids: range
    eval_ids: range
    max_turns: int
    warm_start: Mapping[str, Any]
    target: float
    lr: float
    batch: int = 4
    updates: int = 16
    vocabulary: str = "corridor"
    response_length: int = 384

    def tasks(self, ids: range) -> list[dict[str, int]]:
        return [{"task_id": i} for i in ids]


_LATE = DemoTask(
    "late", "signpost", {"length": 6, "max_steps": 8, "num_tasks": 256, "invalid_penalty": 0.1, "right_door": "red"},
    train_ids=range(0, 192), eval_ids=range(192, 256), max_turns=8,
    warm_start={"episodes": 96, "max_turns": 8, "steps": 200, "expert_prob": 0.97}, target=0.75, lr=5e-4)
# Derived from ``late`` so that the two tasks differ, by construction, only in where the decision sits.
_EARLY = dataclasses.replace(_LATE, name="early", sandbox_config={**_LATE.sandbox_config, "decide_at": "start"})
# The hard pair: eight doors (the green one right), a corridor of eight rooms and two tasks per update, so the warm
# start wins about one episode in eight (module docstring, with what the calibration measured).
_HARD_LATE = DemoTask(
    "hard_late", "signpost",
    {"length": 8, "max_steps": 11, "num_tasks": 256, "invalid_penalty": 0.1, "doors": 8, "right_door": "green"},
    train_ids=range(0, 192), eval_ids=range(192, 256), max_turns=11,
    warm_start={"episodes": 128, "max_turns": 11, "steps": 200, "expert_prob": 0.97, "decay": True}, target=0.75,
    lr=1e-3, batch=2, updates=24, vocabulary="eight_doors")
# Derived from ``hard_late``, as ``early`` from ``late``: only where the decision sits differs.
_HARD_EARLY = dataclasses.replace(_HARD_LATE, name="hard_early",
                                  sandbox_config={**_HARD_LATE.sandbox_config, "decide_at": "start"})
TASKS = {task.name: task for task in (_LATE, _EARLY, _HARD_LATE, _HARD_EARLY)}


def _corpus(task: DemoTask) -> list[str]:
    """The tokenizer's corpus for ``task``: the chats of every task sharing its vocabulary (its own, for a variant
    with a vocabulary of its own)."""
    lines = default_corpus()
    for member in [t for t in TASKS.values() if t.vocabulary == task.vocabulary] or [task]:
        chats = random_policy_chats(member.sandbox, member.sandbox_config, member.tasks(member.train_ids), 256,
                                    member.max_turns, seed=1)
        lines += [m["content"] for chat in chats for m in chat]
    return lines


def warm_start_folder(task: DemoTask, seed: int = 0) -> str:
    """The folder of ``task``'s warm start ``seed`` under the output directory (seed 0 keeps the name it had before
    warm starts were drawn per seed, so its cache stays valid)."""
    return f"tiny_warm_{task.name}" + (f"_seed{seed}" if seed else "")


def task_model(out: Path, task: DemoTask, seed: int = 0) -> Path:
    """The tiny model warm-started on ``task`` (cached under ``out``): one tokenizer per ``task.vocabulary``.

    ``seed`` draws the warm start's demonstrations and batch order (the base model and tokenizer stay the same):
    each seed is another warm start of the same recipe, so a verdict can be measured across warm starts."""
    folder = "tiny" if task.vocabulary == _LATE.vocabulary else f"tiny_{task.vocabulary}"
    tiny = build_tiny_model(out / folder, corpus=_corpus(task))
    return warm_start(tiny, out / warm_start_folder(task, seed), task.sandbox, task.tasks(task.train_ids),
                      dict(task.sandbox_config), **task.warm_start, seed=seed)
