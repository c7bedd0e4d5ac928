"""verl-format datasets of sandbox tasks (:mod:`.rows`) and per-benchmark preparation (:mod:`.prepare`,
``python -m verl_bpo.data.prepare {webshop,alfworld,swebench} --out DIR``)."""

from verl_bpo.data.rows import sandbox_rows, task_row, write_sandbox_dataset

__all__ = ["sandbox_rows", "task_row", "write_sandbox_dataset"]
