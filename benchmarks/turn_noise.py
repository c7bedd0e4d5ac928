"""Where a learning task's gradient noise sits, BPO (``allocation=learned``) against RLOO: a diagnostic.

The allocation model (``verl_bpo.core.shape``) sizes a tree's forks from the return variance each depth injects,
taking every turn's token scores (∇ log π) as independent. This splits the warm-start policy-gradient noise of
``--task`` into each leaf's *walk* (every turn but its last) and its *last turn* (the door, for the episodes that
reach it), and asks whether that assumption holds. Per batch of the learning benchmark's tasks (its trainer, tree
settings and verl loss aggregation; BPO after ``--warmup`` batches that teach its profile; the weights never change),
every generated token gets its loss coefficient c (advantage × mask / rows, verl's ``seq-mean-token-sum-norm`` up to
one constant), and the noise is measured under two score models, with no backward pass:

* ``independent``: every distinct turn's tokens have orthonormal scores (the model's assumption): Σ over distinct
  turns and positions of c², the coefficients of a turn shared by several leaves summed first;
* ``coherent``: every occurrence of a token id has one score (routine turns repeat the same few tokens in alike
  contexts): Σ over token ids of (Σ of its occurrences' c)².

Both are second moments, signal included (at ``hard_late``'s warm start a batch's signal is about a fifth of its
noise: the learning benchmark's ``snr_rloo``); identical tokens in identical contexts do share one score, so the truth
lies between the two.

``--gradient`` also measures the real thing: tr Cov of the batch gradient, each part by zeroing the other's
advantages (the on-policy loss is linear in them, so the parts sum to the whole); it costs two backward passes per
batch and needs many batches (its tail comes from the rare batches with a success). Each figure is per batch ×
generated tokens per batch (matched generated tokens), BPO / RLOO, with a bootstrap CI95 over the batches.

    python benchmarks/turn_noise.py --task hard_late [--batches 200] [--warmup 4] [--gradient]
                                    [--invalid-penalty 0] [--max-steps 16] [--min-depth 7]

``--invalid-penalty`` and ``--max-steps`` measure a variant of the task (its own warm start, built the first time):
whether the walk's noise follows what a wandering walk costs in return (penalised invalid moves, episodes that run
out of steps before the door). ``--min-depth`` keeps the BPO trees from forking above that depth (but at the root):
whether forks on the routine walk are what its noise follows.

Last line: one JSON object: per part (``walk``, ``last``) and score model (``independent``, ``coherent``;
``gradient`` with ``--gradient``) ``bpo_over_rloo`` and ``ci95``; ``tokens`` per batch of each; the settings and
``wall_s``. About six minutes for ``hard_late`` at 200 batches on two cores (four times that with ``--gradient``).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from learning import bootstrap, trace_cov, trainer, tree_settings, warm_start_batches
from noise_screen import variant

from verl_bpo.demo.tasks import TASKS, task_model

PARTS = ("walk", "last")
# One generated turn of one leaf row: its node (shared by the leaves through it), its token ids and loss
# coefficients, and its part (``walk`` or ``last``).
Turn = tuple[object, Sequence[int], Sequence[float], str]


def turn_part(k: int, turns: int) -> str:
    """The part of a leaf's ``k``-th of ``turns`` turns: ``last`` for its last turn, ``walk`` for every other."""
    return "last" if k == turns - 1 else "walk"


def noise_energies(turns: Iterable[Turn]) -> dict[str, dict[str, float]]:
    """Per part (``walk``, ``last``), the ``independent`` and ``coherent`` noise of one batch's turns (module
    docstring)."""
    by_node: dict[object, np.ndarray] = {}
    part_of: dict[object, str] = {}
    by_token: dict[str, collections.defaultdict[int, float]] = {p: collections.defaultdict(float) for p in PARTS}
    for node, ids, coefs, part in turns:
        coefs = np.asarray(coefs, dtype=np.float64)
        by_node[node] = by_node.get(node, 0.0) + coefs
        part_of.setdefault(node, part)
        for token, c in zip(ids, coefs):
            by_token[part][int(token)] += float(c)
    out = {p: {"independent": 0.0, "coherent": sum(v * v for v in by_token[p].values())} for p in PARTS}
    for node, coefs in by_node.items():
        out[part_of[node]]["independent"] += float(np.sum(coefs * coefs))
    return out


def batch_turns(rl, results) -> list[Turn]:
    """The turns of one batch of trees, with the coefficients verl's loss gives their tokens (the trainer's own
    row layout and estimator call, so the coefficients are the ones it trains on)."""
    batch = rl._batch(results)
    coefs = (rl._advantages(batch) * batch["response_mask"]).numpy() / len(batch["leaves"])
    turns = []
    for row, leaf in enumerate(batch["leaves"]):
        ids, spans = leaf.transcript.response_ids, leaf.meta.turn_spans
        for k, (s, e) in enumerate(spans):
            node = (leaf.meta.tree_id, leaf.meta.node_path[k + 1])
            turns.append((node, ids[s:e], coefs[row, s:e], turn_part(k, len(spans))))
    return turns


def part_gradients(rl, results) -> dict[str, np.ndarray]:
    """The batch gradient's walk and last-turn parts: verl's loss with the other part's advantages zeroed."""
    import torch

    full = rl._advantages
    grads = {}
    for part in PARTS:
        def masked(batch, part=part):
            advantages = full(batch)
            keep = torch.zeros_like(advantages)
            for row, leaf in enumerate(batch["leaves"]):
                spans = leaf.meta.turn_spans
                for k, (s, e) in enumerate(spans):
                    keep[row, s:e] = float(turn_part(k, len(spans)) == part)
            return advantages * keep
        rl._advantages = masked
        try:
            rl.gradient(results)
        finally:
            rl._advantages = full
        grads[part] = rl.flat_gradient().astype(np.float64)
    return grads


def measure(model_dir, task, estimator: str, batches: int, warmup: int, seed: int, gradient: bool,
            bpo: dict | None = None) -> dict:
    """Per batch, the noise energies (and gradient parts); the mean generated tokens per batch. ``bpo``: settings
    of the ``bpo:`` block on top of the learning benchmark's."""
    rl = trainer(model_dir, task, estimator, seed, tree_settings(), bpo=bpo)
    energies: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    grads: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    tokens = []
    for results in warm_start_batches(rl, task, seed, batches, warmup):
        tokens.append(sum(r.metrics["bpo/generated_tokens"] for r in results))
        for part, values in noise_energies(batch_turns(rl, results)).items():
            for model, value in values.items():
                energies[(part, model)].append(value)
        if gradient:
            for part, g in part_gradients(rl, results).items():
                grads[part].append(g)
    out = {"tokens": float(np.mean(tokens)), "energies": {k: np.array(v) for k, v in energies.items()}}
    if gradient:
        out["grams"] = {part: np.stack(g) @ np.stack(g).T for part, g in grads.items()}
    return out


def compare(bpo: dict, rloo: dict, batches: int) -> dict:
    """BPO / RLOO of every part and score model, per batch × tokens per batch, with CI95 (resampled batches)."""
    out: dict = {}
    for (part, model), values in bpo["energies"].items():
        base = rloo["energies"][(part, model)]

        def stat(i, values=values, base=base):
            den = base[i].mean() * rloo["tokens"]
            return values[i].mean() * bpo["tokens"] / den if den else float("nan")
        out.setdefault(part, {})[model] = {"bpo_over_rloo": round(float(stat(np.arange(batches))), 3),
                                           "ci95": bootstrap(stat, batches)}
    for part in bpo.get("grams", {}):
        def stat(i, part=part):
            den = trace_cov(rloo["grams"][part], i) * rloo["tokens"]
            return trace_cov(bpo["grams"][part], i) * bpo["tokens"] / den if den else float("nan")
        out[part]["gradient"] = {"bpo_over_rloo": round(float(stat(np.arange(batches))), 3),
                                 "ci95": bootstrap(stat, batches)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="hard_late", choices=sorted(TASKS))
    parser.add_argument("--batches", type=int, default=200, help="measured batches per estimator")
    parser.add_argument("--warmup", type=int, default=4, help="BPO batches that teach the profile first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient", action="store_true", help="also measure the real gradient's parts")
    parser.add_argument("--min-depth", type=int, default=None,
                        help="bpo.min_depth of the BPO trees: no fork above this depth but the root's (default: "
                             "the benchmark's, 1)")
    parser.add_argument("--invalid-penalty", type=float, default=None,
                        help="a variant of the task with this sandbox invalid_penalty (hard_late's: 0.1)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="a variant of the task with this episode step limit (hard_late's: 11)")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"), help="where the warm start is cached")
    args = parser.parse_args()
    t0 = time.monotonic()
    task = variant(TASKS[args.task], None, args.invalid_penalty, args.max_steps)
    model_dir = task_model(args.out, task)
    forks = {} if args.min_depth is None else {"min_depth": args.min_depth}
    runs = {"rloo": measure(model_dir, task, "rloo", args.batches, 0, args.seed, args.gradient),
            "bpo": measure(model_dir, task, "bpo", args.batches, args.warmup, args.seed, args.gradient, forks)}
    result = compare(runs["bpo"], runs["rloo"], args.batches)
    for part, models in result.items():
        print(part, {m: v["bpo_over_rloo"] for m, v in models.items()})
    print(json.dumps({"task": task.name, "sandbox_config": dict(task.sandbox_config), **result,
                      "tokens": {e: round(r["tokens"], 1) for e, r in runs.items()},
                      "batches": args.batches, "warmup": args.warmup, "seed": args.seed, "min_depth": args.min_depth,
                      "wall_s": round(time.monotonic() - t0)}))


if __name__ == "__main__":
    main()
