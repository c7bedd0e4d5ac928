"""The two embedded tasks of the CPU demo and the learning benchmark, and the tiny warm-started model for each.

``late``  — the signpost corridor (:mod:`sandbox_adapters.signpost`) of six rooms: walk east five times
            (routine), then open the right door (the red one, for every task); the outcome is decided by the last
            turn. The warm start walks well and picks doors at random, so a fresh policy succeeds a third to half
            of the time and RL has to learn the choice. (With the right door drawn per task the tiny model learns
            a color preference, not to read the sign, within the updates a 2-core box affords.)
``early`` — the same corridor with the choice first (``decide_at="start"``): open the right door, then walk its
            corridor of six rooms; the first turn decides and the walk only reveals it. Same warm start, learning
            rate and target, so the two tasks differ only in where the decision sits.

Each task has training task ids and disjoint held-out evaluation ids. The tiny model's tokenizer is trained on
both tasks' chats as well, so each action word is one token: a policy-gradient step then moves whole actions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_bpo.demo.tiny_model import build_tiny_model, default_corpus
from verl_bpo.demo.warm_start import random_policy_chats, warm_start

__all__ = ["DemoTask", "TASKS", "task_model"]


@dataclasses.dataclass(frozen=True)
class DemoTask:
    """One embedded task: its sandbox, its task ids, its warm start and the success that counts as learned.

    Attributes:
        name: ``late`` or ``early``.
        sandbox, sandbox_config: the registered sandbox and its ``Config`` keys.
        train_ids, eval_ids: task ids to train on and the disjoint ids evaluation uses.
        max_turns: ``bpo.max_turns``.
        warm_start: keyword arguments of :func:`verl_bpo.demo.warm_start.warm_start`.
        target: the evaluation success that counts as reached (updates-to-target).
        lr: the learning rate every estimator trains this task with.
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

    def tasks(self, ids: range) -> list[dict[str, int]]:
        return [{"task_id": i} for i in ids]


_LATE = DemoTask(
    "late", "signpost", {"length": 6, "max_steps": 8, "num_tasks": 256, "invalid_penalty": 0.1, "right_door": "red"},
    train_ids=range(0, 192), eval_ids=range(192, 256), max_turns=8,
    warm_start={"episodes": 96, "max_turns": 8, "steps": 200, "expert_prob": 0.97}, target=0.75, lr=5e-4)
# Derived from ``late`` so that the two tasks differ, by construction, only in where the decision sits.
_EARLY = dataclasses.replace(_LATE, name="early", sandbox_config={**_LATE.sandbox_config, "decide_at": "start"})
TASKS = {task.name: task for task in (_LATE, _EARLY)}


def _corpus() -> list[str]:
    lines = default_corpus()
    for task in TASKS.values():
        chats = random_policy_chats(task.sandbox, task.sandbox_config, task.tasks(task.train_ids), 256,
                                    task.max_turns, seed=1)
        lines += [m["content"] for chat in chats for m in chat]
    return lines


def task_model(out: Path, task: DemoTask) -> Path:
    """The tiny model warm-started on ``task`` (cached under ``out``): one tokenizer for both tasks."""
    tiny = build_tiny_model(out / "tiny", corpus=_corpus())
    return warm_start(tiny, out / f"tiny_warm_{task.name}", task.sandbox, task.tasks(task.train_ids),
                      dict(task.sandbox_config), **task.warm_start)
