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

__all__ = ["sandbox_rows", "write_sandbox_dataset"]


def sandbox_rows(
    sandbox: str,
    tasks: Sequence[Mapping[str, Any]],
    sandbox_config: Mapping[str, Any] | None = None,
    split: str = "train",
    agent_name: str = "bpo_tree",
) -> list[dict[str, Any]]:
    """One verl row per task, with the prompt rendered by the sandbox itself."""
    rows = []
    box = make_sandbox(sandbox, sandbox_config)
    try:
        for i, task in enumerate(tasks):
            observation = box.reset(task)
            rows.append({
                "data_source": f"bpo/{sandbox}",
                "agent_name": agent_name,
                "prompt": [
                    {"role": "system", "content": box.system_prompt()},
                    {"role": "user", "content": box.first_user_message(observation)},
                ],
                "ability": "agent",
                "reward_model": {"style": "sandbox", "ground_truth": ""},
                "extra_info": {
                    "split": split,
                    "index": i,
                    # JSON strings: parquet would otherwise widen heterogeneous task dicts into sparse columns.
                    "sandbox": json.dumps({"name": sandbox, "config": dict(sandbox_config or {})}),
                    "task": json.dumps(dict(task)),
                },
            })
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
