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

``--gradient`` also measures the real thing: tr Cov of the batch gradient, each part by zeroing the others'
advantages (the on-policy loss is linear in them, so the parts sum to the whole, ``whole``); it costs one backward
pass per part per batch and needs many batches (its tail comes from the rare batches with a success). The parts'
draws give one Gram matrix, cross terms included, so sums of parts are measured too: ``whole``, and with
``--rare-below`` each turn part whole. Each figure is per batch × generated tokens per batch (matched generated
tokens), BPO / RLOO, with a bootstrap CI95 over the batches; ``share`` is each part's tr Cov over the whole's, per
estimator (a point estimate; cross terms between the parts make the shares sum to other than 1).

    python benchmarks/turn_noise.py --task hard_late [--batches 200] [--warmup 4] [--gradient] [--rare-below 0.05]
                                    [--invalid-penalty 0] [--max-steps 16] [--min-depth 7]

``--rare-below P`` splits each part by the sampled token's rollout probability (``walk_rare`` below P,
``walk_common`` at or above, the same for ``last``): a token's score (∇ log π) grows as its probability falls, so a
few rare samples can carry the real gradient's noise where both score models, which weigh every token alike, see
none (the coherent model also loses the cross term of one token id that is rare in one context and common in
another).

``--invalid-penalty`` and ``--max-steps`` measure a variant of the task (its own warm start, built the first time):
whether the walk's noise follows what a wandering walk costs in return (penalised invalid moves, episodes that run
out of steps before the door). ``--min-depth`` keeps the BPO trees from forking above that depth (but at the root):
whether forks on the routine walk are what its noise follows.

Last line: one JSON object: per part (``walk``, ``last``, or their ``_rare`` and ``_common`` halves) and score
model (``independent``, ``coherent``; ``gradient`` with ``--gradient``, with its ``share``) ``bpo_over_rloo`` and
``ci95``; with ``--gradient`` the ``whole`` gradient's; with ``--rare-below`` each turn part whole too (``walk``
and ``last``, the sums of their halves); ``tokens`` per batch of each estimator and
``tokens_per_batch`` of each part (trained tokens, mask 1: a failed turn masked out counts in neither part); the
settings and ``wall_s``. About six minutes for ``hard_late`` at 200 batches on two cores (four times that with
``--gradient``, twice that again with ``--rare-below``).
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
# One generated turn (or the tokens of one part of it) of one leaf row: its node (shared by the leaves through it),
# its token ids and loss coefficients, and its part (``walk`` or ``last``, with ``--rare-below`` ``_rare`` or
# ``_common``).
Turn = tuple[object, Sequence[int], Sequence[float], str]


def parts(rare_below: float | None = None) -> tuple[str, ...]:
    """The parts a batch is split into: ``walk`` and ``last``, each split in two by ``rare_below``."""
    return PARTS if rare_below is None else tuple(f"{p}_{r}" for p in PARTS for r in ("rare", "common"))


def part_sums(rare_below: float | None = None) -> dict[str, tuple[str, ...]]:
    """The sums of parts measured beside the parts: the ``whole`` gradient, and with ``rare_below`` each turn part
    whole (``walk``: ``walk_rare`` + ``walk_common``; the same for ``last``), cross terms included."""
    names = parts(rare_below)
    sums = {"whole": names}
    if rare_below is not None:
        sums.update({p: tuple(n for n in names if n.startswith(f"{p}_")) for p in PARTS})
    return sums


def part_grams(draws: dict[str, Sequence[np.ndarray]], sums: dict[str, tuple[str, ...]],
               chunk: int = 1 << 15) -> dict[str, np.ndarray]:
    """The Gram matrix over the batches of every part's gradient and of every sum of parts: blocks of one Gram of
    all the parts' draws (float64 products, built ``chunk`` parameters at a time so the draws are held once, in
    float32)."""
    names = list(draws)
    n = len(draws[names[0]])
    rows = [g for name in names for g in draws[name]]
    gram = np.zeros((len(rows), len(rows)))
    for start in range(0, len(rows[0]), chunk):
        block = np.stack([g[start:start + chunk] for g in rows], dtype=np.float64)
        gram += block @ block.T
    span = {name: slice(i * n, (i + 1) * n) for i, name in enumerate(names)}
    out = {name: gram[span[name], span[name]] for name in names}
    for name, members in sums.items():
        out[name] = sum(gram[span[a], span[b]] for a in members for b in members)
    return out


def turn_part(k: int, turns: int) -> str:
    """The part of a leaf's ``k``-th of ``turns`` turns: ``last`` for its last turn, ``walk`` for every other."""
    return "last" if k == turns - 1 else "walk"


def token_parts(k: int, turns: int, logprobs: Sequence[float], rare_below: float | None = None) -> list[str]:
    """The part of each token of a leaf's ``k``-th turn, given their rollout log-probabilities: its turn's part,
    with ``rare_below`` suffixed ``_rare`` where the token's probability is below it and ``_common`` elsewhere."""
    part = turn_part(k, turns)
    if rare_below is None:
        return [part] * len(logprobs)
    below = float(np.log(rare_below))
    return [f"{part}_{'rare' if lp < below else 'common'}" for lp in logprobs]


def noise_energies(turns: Iterable[Turn], names: Sequence[str] = PARTS) -> dict[str, dict[str, float]]:
    """Per part of ``names``, the ``independent`` and ``coherent`` noise of one batch's turns (module
    docstring)."""
    by_node: dict[tuple[object, str], np.ndarray] = {}
    by_token: dict[str, collections.defaultdict[int, float]] = {p: collections.defaultdict(float) for p in names}
    for node, ids, coefs, part in turns:
        coefs = np.asarray(coefs, dtype=np.float64)
        by_node[(node, part)] = by_node.get((node, part), 0.0) + coefs
        for token, c in zip(ids, coefs):
            by_token[part][int(token)] += float(c)
    out = {p: {"independent": 0.0, "coherent": sum(v * v for v in by_token[p].values())} for p in names}
    for (_, part), coefs in by_node.items():
        out[part]["independent"] += float(np.sum(coefs * coefs))
    return out


def split_energies(turns: Sequence[Turn], rare_below: float | None = None) -> dict[str, dict[str, float]]:
    """:func:`noise_energies` of every part of one batch's turns and, with ``rare_below``, of each turn part whole:
    its independent noise the sum of its halves' (they hold distinct tokens), its coherent noise that of all its
    tokens (a token id's coefficients summed across both halves)."""
    out = noise_energies(turns, parts(rare_below))
    if rare_below is not None:
        out.update(noise_energies([((node, part), ids, coefs, part.split("_")[0])
                                   for node, ids, coefs, part in turns]))
    return out


def leaf_token_parts(leaf, rare_below: float | None = None) -> list[tuple[int, int, str]]:
    """Every trained token of a leaf row (mask 1; a turn's span also holds the environment's reply, mask 0): its
    turn, its response offset and its part."""
    spans, logprobs, mask = leaf.meta.turn_spans, leaf.transcript.response_logprobs, leaf.transcript.response_mask
    return [(k, s + i, part) for k, (s, e) in enumerate(spans)
            for i, part in enumerate(token_parts(k, len(spans), logprobs[s:e], rare_below)) if mask[s + i]]


def batch_turns(rl, results, rare_below: float | None = None) -> list[Turn]:
    """The turns of one batch of trees (each split by part), with the coefficients verl's loss gives their tokens
    (the trainer's own row layout and estimator call, so the coefficients are the ones it trains on)."""
    batch = rl._batch(results)
    coefs = (rl._advantages(batch) * batch["response_mask"]).numpy() / len(batch["leaves"])
    turns = []
    for row, leaf in enumerate(batch["leaves"]):
        ids = leaf.transcript.response_ids
        by_turn: dict[tuple[int, str], list[int]] = collections.defaultdict(list)
        for k, offset, part in leaf_token_parts(leaf, rare_below):
            by_turn[(k, part)].append(offset)
        for (k, part), offsets in by_turn.items():
            node = (leaf.meta.tree_id, leaf.meta.node_path[k + 1])
            turns.append((node, [ids[i] for i in offsets], coefs[row, offsets], part))
    return turns


def part_gradients(rl, results, rare_below: float | None = None) -> dict[str, np.ndarray]:
    """The batch gradient's parts: verl's loss with every other part's advantages zeroed."""
    import torch

    full = rl._advantages
    grads = {}
    for name in parts(rare_below):
        def masked(batch, name=name):
            advantages = full(batch)
            keep = torch.zeros_like(advantages)
            for row, leaf in enumerate(batch["leaves"]):
                for _, offset, part in leaf_token_parts(leaf, rare_below):
                    keep[row, offset] = float(part == name)
            return advantages * keep
        rl._advantages = masked
        try:
            rl.gradient(results)
        finally:
            rl._advantages = full
        grads[name] = rl.flat_gradient()
    return grads


def measure(model_dir, task, estimator: str, batches: int, warmup: int, seed: int, gradient: bool,
            bpo: dict | None = None, rare_below: float | None = None) -> dict:
    """Per batch, the noise energies; with ``gradient`` the Gram matrices over the batches of the gradient's parts
    and of their sums (:func:`part_grams`); the mean generated tokens per batch, and per part. ``bpo``: settings of
    the ``bpo:`` block on top of the learning benchmark's."""
    rl = trainer(model_dir, task, estimator, seed, tree_settings(), bpo=bpo)
    names = parts(rare_below)
    energies: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    grads: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    tokens, part_tokens = [], collections.Counter()
    for results in warm_start_batches(rl, task, seed, batches, warmup):
        tokens.append(sum(r.metrics["bpo/generated_tokens"] for r in results))
        turns = batch_turns(rl, results, rare_below)
        for _, ids, _, part in {(t[0], t[3]): t for t in turns}.values():  # each distinct turn once
            part_tokens[part] += len(ids)
        for part, values in split_energies(turns, rare_below).items():
            for model, value in values.items():
                energies[(part, model)].append(value)
        if gradient:
            for part, g in part_gradients(rl, results, rare_below).items():
                grads[part].append(g)
    out = {"tokens": float(np.mean(tokens)), "energies": {k: np.array(v) for k, v in energies.items()},
           "part_tokens": {p: part_tokens[p] / batches for p in names}}
    if gradient:
        out["grams"] = part_grams(grads, part_sums(rare_below))
    return out


def share(grams: dict[str, np.ndarray], part: str) -> float:
    """``part``'s tr Cov over the whole gradient's (NaN when the whole has none: every advantage zero)."""
    whole = trace_cov(grams["whole"])
    return round(trace_cov(grams[part]) / whole, 3) if whole else float("nan")


def compare(bpo: dict, rloo: dict, batches: int) -> dict:
    """BPO / RLOO of every part and score model, per batch × tokens per batch, with CI95 (resampled batches); with
    gradients, each part's share of each estimator's tr Cov (cross terms between parts make the shares sum to other
    than 1), and the whole gradient's ratio."""
    out: dict = {}
    runs = (("bpo", bpo), ("rloo", rloo))
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
        out.setdefault(part, {})["gradient"] = {
            "bpo_over_rloo": round(float(stat(np.arange(batches))), 3), "ci95": bootstrap(stat, batches),
            **({} if part == "whole" else {"share": {e: share(r["grams"], part) for e, r in runs}})}
    return out


def probability(text: str) -> float:
    """``--rare-below``'s value: a probability in (0, 1]."""
    p = float(text)
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"--rare-below takes a probability in (0, 1], got {p}: e.g. 0.05")
    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="hard_late", choices=sorted(TASKS))
    parser.add_argument("--batches", type=int, default=200, help="measured batches per estimator")
    parser.add_argument("--warmup", type=int, default=4, help="BPO batches that teach the profile first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient", action="store_true", help="also measure the real gradient's parts")
    parser.add_argument("--rare-below", type=probability, default=None,
                        help="split each part by the sampled token's probability at this threshold (e.g. 0.05)")
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
    runs = {"rloo": measure(model_dir, task, "rloo", args.batches, 0, args.seed, args.gradient,
                            rare_below=args.rare_below),
            "bpo": measure(model_dir, task, "bpo", args.batches, args.warmup, args.seed, args.gradient, forks,
                           args.rare_below)}
    result = compare(runs["bpo"], runs["rloo"], args.batches)
    for part, models in result.items():
        print(part, {m: v["bpo_over_rloo"] for m, v in models.items()})
    print(json.dumps({"task": task.name, "sandbox_config": dict(task.sandbox_config), **result,
                      "tokens": {e: round(r["tokens"], 1) for e, r in runs.items()},
                      "tokens_per_batch": {e: {p: round(n, 1) for p, n in r["part_tokens"].items()}
                                           for e, r in runs.items()},
                      "batches": args.batches, "warmup": args.warmup, "seed": args.seed, "min_depth": args.min_depth,
                      "rare_below": args.rare_below, "wall_s": round(time.monotonic() - t0)}))


if __name__ == "__main__":
    main()
