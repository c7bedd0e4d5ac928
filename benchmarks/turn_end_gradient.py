"""Why BPO's turns can lengthen: the batch gradient along the turn-end direction, BPO vs RLOO, at the warm start.

A turn ends when the policy samples its end-of-turn token. At the warm start that token is nearly certain after an
action (p ≈ 0.996 on the late task), and a turn that runs on ("east east east ...") still acts in the signpost
corridor, so the return barely depends on where turns end: along the direction

    d = ∇θ mean log p(end-of-turn token at each turn's end)     (over flat episodes of the warm-start policy)

the true policy gradient is about 0. An unbiased estimator's batch gradient then has mean ≈ 0 along d, and its
noise there moves the policy at random; only one side of that walk shows (p cannot rise visibly above 0.996, it can
fall), as turns that run on to ``bpo.max_tokens_per_turn``. This measures, per estimator, on
``benchmarks/learning.py``'s trainer, task and tree settings (BPO: learned allocation, its token budget learned from
``--warmup`` batches first), ``--draws`` batch gradients ĝ at the warm-start policy and their projection ĝ·d/‖d‖:

* ``<est>_mean_z`` — the projection's mean over its standard error: a bias toward longer (z > 0: the loss gradient's
  step lowers p) or shorter turns shows as |z| >> 2;
* ``turn_end_var_bpo_over_rloo`` — the projection's variance, BPO over RLOO, × generated tokens per batch (matched
  generated tokens), with a bootstrap CI95: how much faster BPO's turn ends random-walk per update;
* ``<est>_adam_walk_eps<eps>`` — what the optimizer makes of that noise: AdamW's update rule (torch's, betas 0.9 and
  0.999, clipped as the trainer clips) on the same draws resampled into 64 sequences of ``--updates`` steps (the
  demo's run), and the RMS over sequences of the weights' displacement along d at the end, in units of the learning
  rate. AdamW divides each weight's gradient by that weight's RMS gradient plus ``eps``, so a weight whose gradient is
  noise well above ``eps`` moves by about the learning rate per update however small the noise; an ``eps`` above the
  noise damps it. ``adam_walk_bpo_over_rloo_eps<eps>``: BPO's over RLOO's, at each ``eps`` of ``--eps``.

    python benchmarks/turn_end_gradient.py [--task late] [--draws 96] [--eps 1e-5 1e-4]

Last line: one JSON object with those keys, ``<est>_tokens_per_batch`` and ``p_turn_end``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from learning import bootstrap, trainer, tree_settings
from noise_screen import adam_walk

from verl_bpo.demo.tasks import TASKS, task_model


def turn_end_direction(rl, tasks: list[dict], episodes: int) -> tuple[np.ndarray, float]:
    """d (as one vector over every parameter) and the mean p of the turn-end token, from flat episodes."""
    import torch

    results = rl.rollout(tasks, rollout_n=episodes, estimator="grpo", stream="direction")  # not a measured draw
    leaves = [leaf for r in results for leaf in r.leaves]
    length = max(len(leaf.transcript.response_mask) for leaf in leaves)
    rl.model.train()
    rl.optimizer.zero_grad()
    log_probs = rl._response_log_probs(leaves, length)
    ends = torch.zeros_like(log_probs)
    for i, leaf in enumerate(leaves):
        response = leaf.transcript.token_ids[leaf.transcript.prompt_length:][:length]
        for j, token in enumerate(response):
            if leaf.transcript.response_mask[j] and token in rl.client.eos_ids:
                ends[i, j] = 1.0
    (log_probs * ends).sum().div(ends.sum()).backward()
    p = float((log_probs.detach().exp() * ends).sum() / ends.sum())
    d = rl.flat_gradient().astype(np.float64)
    return d / np.linalg.norm(d), p


def gradients(rl, tasks: list[dict], draws: int, warmup: int) -> tuple[np.ndarray, float]:
    """``draws`` batch gradients at the current weights, one row each, and the mean generated tokens per batch."""
    rows, tokens = [], []
    for k in range(warmup + draws):
        rl.updates = k  # a fresh tree seed per draw; the weights never change
        results = rl.rollout(tasks)
        if k < warmup:  # BPO's profile and costs learn from these; not measured
            continue
        rl.gradient(results)
        rows.append(rl.flat_gradient().astype(np.float32))
        tokens.append(sum(r.metrics["bpo/generated_tokens"] for r in results))
    return np.stack(rows), float(np.mean(tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="late", choices=list(TASKS))
    parser.add_argument("--draws", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=4, help="BPO batches that teach its profile first")
    parser.add_argument("--episodes", type=int, default=4, help="flat episodes per task for the direction d")
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-5, 1e-4], help="AdamW eps values to compare")
    parser.add_argument("--updates", type=int, default=24, help="AdamW steps per resampled sequence")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"), help="the tiny model's cache")
    args = parser.parse_args()
    start = time.monotonic()
    task = TASKS[args.task]
    model_dir = task_model(args.out.resolve(), task)
    batch = task.tasks(task.train_ids)[: task.batch]
    d, p_end = None, 0.0
    result: dict = {"task": args.task, "draws": args.draws}
    proj: dict[str, tuple[np.ndarray, float]] = {}
    walk: dict[str, dict[float, float]] = {}
    for estimator in ("bpo", "rloo"):
        rl = trainer(model_dir, task, estimator, 0, tree_settings())
        if d is None:
            d, p_end = turn_end_direction(rl, task.tasks(task.train_ids)[:16], args.episodes)
        draws, tokens = gradients(rl, batch, args.draws, args.warmup if estimator == "bpo" else 0)
        values = draws.astype(np.float64) @ d
        proj[estimator] = values, tokens
        walk[estimator] = {eps: float(np.sqrt(np.mean(np.square(
            adam_walk(draws, d.astype(np.float32), args.updates, 1.0, eps, sims=64, seed=0)[:, -1]))))
            for eps in args.eps}
        z = values.mean() / (values.std(ddof=1) / np.sqrt(len(values)))
        result.update({f"{estimator}_mean_z": round(float(z), 2),
                       f"{estimator}_std": float(f"{values.std(ddof=1):.3g}"),
                       f"{estimator}_tokens_per_batch": round(tokens, 1),
                       **{f"{estimator}_adam_walk_eps{eps:g}": round(w, 3) for eps, w in walk[estimator].items()}})
        print(f"{estimator}: projection mean {values.mean():.3g} (z {z:.2f}), std {values.std(ddof=1):.3g}, "
              f"{tokens:.0f} tokens per batch; AdamW's walk along d after {args.updates} updates (RMS, x lr): "
              + ", ".join(f"eps {eps:g}: {w:.3f}" for eps, w in walk[estimator].items()), flush=True)
    (b, tok_b), (r, tok_r) = proj["bpo"], proj["rloo"]

    def ratio(i: np.ndarray) -> float:
        return float(np.var(b[i], ddof=1) * tok_b / (np.var(r[i], ddof=1) * tok_r))

    result.update({"turn_end_var_bpo_over_rloo": round(ratio(np.arange(args.draws)), 3),
                   "ci95": bootstrap(ratio, args.draws), "p_turn_end": round(p_end, 4),
                   **{f"adam_walk_bpo_over_rloo_eps{eps:g}": round(walk["bpo"][eps] / walk["rloo"][eps], 3)
                      for eps in args.eps},
                   "wall_s": round(time.monotonic() - start)})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
