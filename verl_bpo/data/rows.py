"""verl-format datasets of sandbox tasks: one parquet row per task, read by verl's RLHFDataset.

Each row carries what verl needs (``data_source``, ``prompt`` as chat messages, ``reward_model``, ``agent_name``)
and what the ``bpo_tree`` agent loop needs in ``extra_info``: the sandbox (``{"name", "config"}``) and the task.
The ``prompt`` is the sandbox's own rendering of the task (system prompt + first observation), so prompt-length
filters and validation logs see the real prompt; the agent loop re-renders it from a fresh reset.

A row may also carry ``extra_info.bpo_budget`` (``budgets=``): its task's tree budget under
``bpo.allocation=learned``, a positive number in the unit of ``bpo.learned.budget_unit`` (turns, tokens or leaves),
used instead of the budget the run learns, e.g. what a baseline's group generated on the same task, for a comparison
at matched compute.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_adapters.registry import make_sandbox

__all__ = ["task_row", "sandbox_rows", "write_sandbox_dataset"]


def task_row(sandbox: str, task: Mapping[str, Any], sandbox_config: Mapping[str, Any] | None,
             prompt: list[dict[str, str]], split: str, index: int, agent_name: str = "bpo_tree",
             budget: float | None = None) -> dict[str, Any]:
    """One verl row: what verl's RLHFDataset reads plus the sandbox and task the agent loop needs, and the task's
    tree budget (``extra_info.bpo_budget``) when ``budget`` is given."""
    row = {
        "data_source": f"bpo/{sandbox}",
        "agent_name": agent_name,
        "prompt": prompt,
        "ability": "agent",
        "reward_model": {"style": "sandbox", "ground_truth": ""},
        "extra_info": {
            "split": split,
            "index": index,
            # JSON strings: parquet would otherwise widen heterogeneous task dicts into sparse columns.
            "sandbox": json.dumps({"name": sandbox, "config": dict(sandbox_config or {})}),
            "task": json.dumps(dict(task)),
        },
    }
    if budget is not None:
        row["extra_info"]["bpo_budget"] = _positive(budget, index)
    return row


def _positive(budget: Any, index: int) -> float:
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"the budget of task {index} must be a positive number (extra_info.bpo_budget, in "
                         f"the unit of bpo.learned.budget_unit), got {budget!r}")
    return float(budget)


def sandbox_rows(
    sandbox: str,
    tasks: Sequence[Mapping[str, Any]],
    sandbox_config: Mapping[str, Any] | None = None,
    split: str = "train",
    agent_name: str = "bpo_tree",
    render: bool = True,
    budgets: Sequence[float | None] | None = None,
) -> list[dict[str, Any]]:
    """One verl row per task, with the prompt rendered by the sandbox itself.

    ``render=False`` writes a labelled placeholder prompt instead of resetting a sandbox per task (for engines that
    are absent on the machine preparing the data); the agent loop renders the real prompt at every reset anyway.
    ``budgets``: one per task, each task's tree budget (``extra_info.bpo_budget``; ``None``: the learned one).
    """
    if budgets is None:
        budgets = [None] * len(tasks)
    elif len(budgets) != len(tasks):
        raise ValueError(f"{len(budgets)} budgets for {len(tasks)} tasks: give one per task (None for the learned one)")
    if not render:
        return [task_row(sandbox, task, sandbox_config, [
            {"role": "system", "content": f"[placeholder: the {agent_name} agent loop renders the {sandbox} prompt "
                                          "from a sandbox reset]"},
            {"role": "user", "content": json.dumps(dict(task))[:2000]},
        ], split, i, agent_name, budget) for i, (task, budget) in enumerate(zip(tasks, budgets))]
    rows = []
    box = make_sandbox(sandbox, sandbox_config)
    try:
        for i, (task, budget) in enumerate(zip(tasks, budgets)):
            observation = box.reset(task)
            rows.append(task_row(sandbox, task, sandbox_config, box.opening_chat(observation), split, i, agent_name,
                                 budget))
    finally:
        box.close()
    return rows


def write_sandbox_dataset(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write rows as a parquet file verl's ``data.train_files`` / ``data.val_files`` accept."""
    import pandas as pd

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(rows)).to_parquet(out)
    return out
