"""How far the first policy updates move the warm start's first action, per estimator and AdamW ``eps``.

On the learning benchmark's tasks (``verl_bpo.demo.tasks``) a run can collapse within its first updates: the first
turn stops starting with its action word and every episode fails. This measures, for each estimator of
``benchmarks/learning.py`` (the same trainer, task order and tree settings) and each ``--eps``, the probability
the policy gives the first token of the right first action (``open`` on the early task) at a training task's
first prompt, before and after each of the first ``--updates`` updates. A seed *drops* when that probability falls
below ``--drop`` at any of them. As in the learning benchmark, GRPO trains first and each BPO tree's token budget is
the tokens GRPO's group generated on the same task, update and seed; each update's training success and pre-clip
gradient norm are printed beside the probability.

Why ``eps`` matters: Adam's first steps move every weight by about the learning rate whatever the size of its
gradient (m / √v is ±1 on the first step), so weights the batch barely touches move as far as the ones it
decides. An ``eps`` near the per-weight gradient size (about 1.5e-5 here: gradient norms near 0.01 over the tiny
model's 430 000 weights) damps them.

    python benchmarks/first_updates.py [--task early] [--seeds 4] [--updates 3] [--eps 1e-8 1e-5] [--lr 3e-4]

Last line: one JSON object: per ``eps``, per estimator, the seeds that dropped and the lowest probability seen,
and ``dropped_share_ratio`` (the share of dropped runs at the last ``eps`` over that at the first, all estimators).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from learning import BASELINES, ESTIMATORS, task_order, trainer, tree_settings, update_batch
from transformers import AutoTokenizer

from sandbox_adapters.registry import make_sandbox
from verl_bpo.demo.tasks import TASKS, DemoTask, task_model
from verl_bpo.local.hf_client import TemplateCodec


def first_prompt(task: DemoTask, tokenizer) -> tuple[list[int], int]:
    """The first prompt of the first training task and the first token of its right action."""
    box = make_sandbox(task.sandbox, task.sandbox_config)
    observation = box.reset(task.tasks(task.train_ids)[0])
    prompt = asyncio.run(TemplateCodec(tokenizer).start(box.opening_chat(observation)))
    return prompt, tokenizer.encode(box.best_action(), add_special_tokens=False)[0]


def first_action_probability(rl, prompt: list[int], token: int) -> float:
    import torch

    with torch.no_grad():
        logits = rl.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return float(torch.softmax(logits, -1)[token])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="early", choices=list(TASKS))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-8, 1e-5])
    parser.add_argument("--drop", type=float, default=0.5, help="a seed drops below this first-action probability")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the task's)")
    parser.add_argument("--out", type=Path, default=Path("runs/first_updates"))
    args = parser.parse_args()
    start = time.monotonic()
    task = TASKS[args.task]
    model_dir = task_model(args.out.resolve(), task)
    prompt, token = first_prompt(task, AutoTokenizer.from_pretrained(model_dir))
    tree = tree_settings()  # learning.py's defaults
    result: dict = {}
    budgets: dict[tuple[int, int], list[float]] = {}  # (seed, update) -> GRPO's tokens per task
    for eps in args.eps:
        cell = result[f"eps_{eps:g}"] = {}
        for estimator in (*BASELINES, "bpo"):  # GRPO before BPO: its groups' tokens are BPO's budgets
            dropped, lowest = [], 1.0
            for seed in range(args.seeds):
                rl = trainer(model_dir, task, estimator, seed, tree, adam_eps=eps, lr=args.lr)
                order = task_order(task, seed)
                curve, line = [first_action_probability(rl, prompt, token)], []
                for u in range(args.updates):
                    stats = rl.step(update_batch(order, u, task.batch),
                                    budgets[seed, u] if estimator == "bpo" else None)
                    if estimator == "grpo":
                        budgets[seed, u] = stats.tree_tokens
                    curve.append(first_action_probability(rl, prompt, token))
                    line.append(f"success {stats.success_rate:.2f} grad {stats.grad_norm:.4f}")
                print(f"eps {eps:g} {estimator:4s} seed {seed}: p(first action) "
                      + " ".join(f"{p:.3f}" for p in curve) + " | " + ", ".join(line), flush=True)
                lowest = min(lowest, *curve)
                if min(curve) < args.drop:
                    dropped.append(seed)
            cell[estimator] = {"dropped_seeds": dropped, "lowest_p": round(lowest, 4)}
    shares = [sum(len(c[e]["dropped_seeds"]) for e in ESTIMATORS) / (len(ESTIMATORS) * args.seeds)
              for c in result.values()]
    result.update({"task": args.task, "seeds": args.seeds, "updates": args.updates, "lr": args.lr or task.lr,
                   "dropped_share": [round(s, 4) for s in shares],
                   "dropped_share_ratio": round(shares[-1] / shares[0], 4) if shares[0] else None,
                   "wall_s": round(time.monotonic() - start)})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
