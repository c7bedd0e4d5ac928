"""Toy inputs for verl's stock trainer in the CPU tests: arithmetic tasks as a verl parquet, and a reward file."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

LENGTH_REWARD = '''"""Toy reward with variance within a group, so that GRPO advantages and gradients are non-zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(solution_str) % 7) / 7.0
'''


def arithmetic_examples(count: int, seed: int = 0) -> list[dict]:
    """``count`` "What is a plus b?" tasks as ``{"question", "answer"}`` dicts."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        examples.append({"question": f"What is {a} plus {b}?", "answer": str(a + b)})
    return examples


def write_verl_dataset(path: str | Path, examples: Sequence[Mapping], data_source: str = "bpo/toy") -> Path:
    """Write ``examples`` (dicts with ``question``, ``answer`` and optional ``extra_info``) as a verl parquet.

    Columns follow verl's RL dataset: ``data_source``, ``prompt`` (chat messages), ``ability``,
    ``reward_model.{style,ground_truth}``, ``extra_info`` (split, index and anything given).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": ex["question"]}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": str(ex["answer"])},
            "extra_info": {"split": "train", "index": i, **dict(ex.get("extra_info", {}))},
        }
        for i, ex in enumerate(examples)
    ]
    pd.DataFrame(rows).to_parquet(path)
    return path


def write_length_reward(path: str | Path) -> Path:
    """Write a ``reward.custom_reward_function.path`` file scoring responses by length mod 7 (random models
    never solve a task, so a correctness reward would give all-zero advantages)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(LENGTH_REWARD)
    return path
