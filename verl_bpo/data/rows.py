"""verl-format datasets of sandbox tasks: one parquet row per task, read by verl's RLHFDataset.

Each row carries what verl needs (``data_source``, ``prompt`` as chat messages, ``reward_model``, ``agent_name``)
and what the ``bpo_tree`` agent loop needs in ``extra_info``: the sandbox (``{"name", "config"}``) and the task.
The ``prompt`` is the sandbox's own rendering of the task (system prompt + first observation), so prompt-length
filters and validation logs see the real prompt; the agent loop re-renders it from a fresh reset.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandbox_adapters.registry import make_sandbox

__all__ = ["task_row", "sandbox_rows", "write_sandbox_dataset"]


def task_row(sandbox: str, task: Mapping[str, Any], sandbox_config: Mapping[str, Any] | None,
             prompt: list[dict[str, str]], split: str, index: int, agent_name: str = "bpo_tree") -> dict[str, Any]:
    """One verl row: what verl's RLHFDataset reads plus the sandbox and task the agent loop needs."""
    return {
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


def sandbox_rows(
    sandbox: str,
    tasks: Sequence[Mapping[str, Any]],
    sandbox_config: Mapping[str, Any] | None = None,
    split: str = "train",
    agent_name: str = "bpo_tree",
    render: bool = True,
) -> list[dict[str, Any]]:
    """One verl row per task, with the prompt rendered by the sandbox itself.

    ``render=False`` writes a labelled placeholder prompt instead of resetting a sandbox per task (for engines that
    are absent on the machine preparing the data); the agent loop renders the real prompt at every reset anyway.
    """
    if not render:
        return [task_row(sandbox, task, sandbox_config, [
            {"role": "system", "content": f"[placeholder: the {agent_name} agent loop renders the {sandbox} prompt "
                                          "from a sandbox reset]"},
            {"role": "user", "content": json.dumps(dict(task))[:2000]},
        ], split, i, agent_name) for i, task in enumerate(tasks)]
    rows = []
    box = make_sandbox(sandbox, sandbox_config)
    try:
        for i, task in enumerate(tasks):
            observation = box.reset(task)
            rows.append(task_row(sandbox, task, sandbox_config, box.opening_chat(observation), split, i, agent_name))
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
