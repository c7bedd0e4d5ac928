"""What a verl training step costs on CPU against what its model costs: the same batches through verl's trainer
step and through a plain in-process torch forward+backward.

    python benchmarks/cpu_step.py [--steps 6] [--out runs/cpu_step] [--extra OVERRIDE ...]

1. Trains the CPU demo's model and task (``verl_bpo.demo.tasks``: the tiny warm-started Qwen2, 427k parameters, on
   the late-decision corridor) through ``python -m verl_bpo.main`` with ``verl_bpo.platforms.cpu_launch``'s
   overrides, at a fixed shape: 4 tasks x 8 leaves = 32 rows of ~300 tokens per step (``bpo.fixed.k=2``, the fixed
   allocation), for ``--steps`` steps. A replay buffer subclass (``CaptureReplayBuffer`` below, through verl's
   ``trainer.v1.sampler.custom_sampler`` hook) saves every step's batch: prompt and response token ids and the
   response mask.
2. Runs each captured batch through the same checkpoint in plain torch in this process: a no-grad forward with
   log-probs of the response tokens (verl's ``old_log_prob``), and a forward, a policy-gradient style loss on the
   response tokens, a backward and an AdamW step (verl's ``update_actor``). fp32, rows right-padded to the longest
   of the batch, torch's default thread count.
3. Prints verl's per-step times (steps after the first, which compiles and warms up) and the torch times, then
   one JSON line: the medians' ratios and verl's median step time.

``--extra`` appends hydra overrides to the trainer run. The settings before the CPU platform's step fixes:
``--extra actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.enable_gradient_checkpointing=True
+trainer.v1.sampler.sampler_kwargs.poll_interval_s=2.0``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from verl_bpo.platforms.replay_poll import QuickPollReplayBuffer

CAPTURE_FIELDS = ["prompts", "responses", "response_mask"]
BATCH, LEAVES = 4, 8  # tasks per step x leaves per task: the CPU demo's 32 rows


class CaptureReplayBuffer(QuickPollReplayBuffer):
    """The CPU platform's replay buffer, saving each sampled training batch to ``sampler_kwargs.capture_dir``."""

    def __init__(self, **kwargs: Any) -> None:
        poll = (kwargs.get("sampler_kwargs") or {}).get("poll_interval_s")  # verl's 2 s, for a run before the fix
        if poll is not None:
            kwargs["poll_interval"] = float(poll)
        super().__init__(**kwargs)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        batch, metrics = super().sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        capture_dir = (self.sampler_kwargs or {}).get("capture_dir")
        if capture_dir and partition_id == "train":
            import torch
            import transfer_queue as tq

            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=CAPTURE_FIELDS)
            rows = {field: [t.tolist() for t in data[field].unbind(0)] for field in CAPTURE_FIELDS}
            torch.save(rows, Path(capture_dir) / f"step{global_steps}.pt")
        return batch, metrics


def torch_times(model_path: Path, batch: dict[str, list], repeats: int = 3) -> tuple[float, float]:
    """Median seconds of (no-grad log-prob forward, forward+backward+AdamW step) over ``repeats`` on one batch."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = [p + r for p, r in zip(batch["prompts"], batch["responses"])]
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, (p, r, m) in enumerate(zip(batch["prompts"], batch["responses"], batch["response_mask"])):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p): len(p) + len(r)] = torch.tensor(m, dtype=torch.float32)
    targets, loss_mask = input_ids[:, 1:], loss_mask[:, 1:]

    def log_probs():
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)

    forward, update = [], []
    for _ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        with torch.no_grad():
            log_probs()
        middle = time.perf_counter()
        loss = -(log_probs() * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        forward.append(middle - start)
        update.append(time.perf_counter() - middle)
    return statistics.median(forward[1:]), statistics.median(update[1:])


def overrides(model: Path, data: Path, out: Path, steps: int, capture: Path, extra: list[str]) -> list[str]:
    """The trainer overrides of the measured run (tests compose and validate them)."""
    from verl_bpo.demo.tasks import TASKS
    from verl_bpo.platforms import cpu_launch

    task = TASKS["late"]
    return cpu_launch.cpu_overrides(
        model, data, data, output_dir=out / "run", n=LEAVES, batch_size=BATCH, steps=steps, adv_estimator="bpo",
        max_prompt_length=192, max_response_length=320, lr=1e-3,
    ) + [
        "bpo.fixed.k=2", "bpo.max_tokens_per_turn=6", f"bpo.max_turns={task.max_turns}",
        f"bpo.sandbox.name={task.sandbox}",
        *(f"+bpo.sandbox.config.{k}={v}" for k, v in task.sandbox_config.items()),
        f"trainer.v1.sampler.custom_sampler.path={Path(__file__).resolve()}",
        f"trainer.v1.sampler.custom_sampler.name={CaptureReplayBuffer.__name__}",
        f"+trainer.v1.sampler.sampler_kwargs.capture_dir={capture}",
        *extra,
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/cpu_step"))
    parser.add_argument("--extra", nargs="*", default=[], help="hydra overrides appended to the trainer run")
    args = parser.parse_args(argv)

    from verl_bpo.data import sandbox_rows, write_sandbox_dataset
    from verl_bpo.demo.tasks import TASKS, task_model
    from verl_bpo.platforms import cpu_launch

    out = args.out.resolve()
    task = TASKS["late"]
    model = task_model(out / "model", task)
    data = write_sandbox_dataset(out / "data" / "train.parquet", sandbox_rows(
        task.sandbox, task.tasks(task.train_ids[: BATCH * (args.steps + 1)]), task.sandbox_config))
    capture = out / "batches"
    capture.mkdir(parents=True, exist_ok=True)
    for old in capture.glob("*.pt"):
        old.unlink()
    result = cpu_launch.run_trainer(overrides(model, data, out, args.steps, capture, args.extra),
                                    log_path=out / "run" / "console.log", module="verl_bpo.main",
                                    timeout_s=900 + 60 * args.steps)
    if result.returncode != 0:
        raise SystemExit(f"trainer run failed (exit {result.returncode}):\n" + "\n".join(result.log.splitlines()[-40:]))
    steps = sorted(s for s in result.metrics if s > 1)  # step 1 compiles and warms up
    verl = {key: [result.metrics[s][f"timing_s/{key}"] for s in steps] for key in ("update_actor", "old_log_prob",
                                                                                  "gen", "step")}
    torch_forward, torch_update = [], []
    for step in steps:
        path = capture / f"step{step}.pt"
        if path.exists():
            import torch

            forward, update = torch_times(model, torch.load(path))
            torch_forward.append(forward)
            torch_update.append(update)
    if not torch_forward:
        raise SystemExit(f"no captured batches under {capture}")
    rows = [result.metrics[s].get("response_length/mean", 0) + result.metrics[s].get("prompt_length/mean", 0)
            for s in steps]
    print(f"trainer run: {result.wall_s:.0f} s wall, {len(steps)} measured steps, ~{statistics.mean(rows):.0f} "
          f"tokens per row")
    for key, values in verl.items():
        print(f"  verl {key:>13}: median {statistics.median(values):6.3f} s   per step {[round(v, 2) for v in values]}")
    print(f"  torch    log-prob fwd: median {statistics.median(torch_forward):6.3f} s")
    print(f"  torch fwd+bwd+AdamW  : median {statistics.median(torch_update):6.3f} s")
    summary = {
        "update_actor_over_torch": round(statistics.median(verl["update_actor"]) / statistics.median(torch_update), 2),
        "old_log_prob_over_torch": round(statistics.median(verl["old_log_prob"]) / statistics.median(torch_forward),
                                         2),
        "step_s": round(statistics.median(verl["step"]), 2),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
