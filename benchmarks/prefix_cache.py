"""What the in-process client's prefix cache saves on a multi-turn rollout: cached vs uncached, side by side.

``verl_bpo.local.hf_client.BatchedHFClient`` keeps each generated sequence's keys and values (``PrefixCache``), so
a turn prefills only the observation and the tokens its cached prefix lacks instead of the whole chat. This loads
a learning task's warm start 0 (``benchmarks/learning.py``'s, built under ``--out`` when missing) and, alternating
``--repeats`` times after one untimed round, with the cache on and off on the same weights:

* ``evaluation``: one sampled episode on each of the task's evaluation tasks (the learning benchmark's held-out
  evaluation, flat episodes);
* ``tree``: one update's BPO trees (the task's batch, ``allocation=learned`` after its exploration trees: forks
  share their prefix, so a tree reuses its parent's values too).

Each is timed, wall and inside ``generate``, and every leaf of the cached runs is checked against a full forward of
its chat: the largest difference between a sampled token's log-probability from the rollout and the teacher-forced
one (the cache must not change what is sampled from).

    python benchmarks/prefix_cache.py [--task real_late] [--repeats 3] [--out runs/learning]

Last line: one JSON object: per rollout kind the wall and ``generate`` seconds per repeat with and without the
cache, their ratios ``wall_cached_over_uncached`` (target <= 0.5 on ``real_late``'s evaluation, 8-turn episodes) and
``generate_cached_over_uncached``, the cache's hit share (requests that found a cached prefix), and
``max_log_prob_diff`` (target < 1e-3).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from learning import BENCHMARK_TASKS, task_at_warm_start, trainer, tree_settings


def timed_rollout(rl, run) -> tuple[float, float, list]:
    """``run()``'s wall seconds, the seconds spent in the client's batched ``generate``, and its results."""
    spent = [0.0]
    generate = rl.client._generate_batch

    def timed(batch):
        start = time.monotonic()
        try:
            return generate(batch)
        finally:
            spent[0] += time.monotonic() - start

    rl.client._generate_batch = timed
    try:
        start = time.monotonic()
        results = run()
        return time.monotonic() - start, spent[0], results
    finally:
        rl.client._generate_batch = generate


def max_log_prob_diff(rl, results) -> float:
    """The largest |rollout − teacher-forced| log-probability over the sampled tokens of every leaf."""
    import torch

    leaves = [leaf for r in results for leaf in r.leaves]
    length = max(len(leaf.transcript.response_mask) for leaf in leaves)
    with torch.no_grad():
        forced = rl._response_log_probs(leaves, length)
    worst = 0.0
    for row, leaf in enumerate(leaves):
        mask = np.array(leaf.transcript.response_mask, dtype=bool)
        rollout = np.array(leaf.transcript.response_logprobs)[mask]
        worst = max(worst, float(np.max(np.abs(forced[row, : len(mask)].numpy()[mask] - rollout), initial=0.0)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="hard_late", choices=list(BENCHMARK_TASKS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    args = parser.parse_args()
    start = time.monotonic()
    task, model_dir = task_at_warm_start(args.task, args.out.resolve())
    tree = tree_settings(32, 0)  # no exploration-only trees: the learned plan from the first tree
    flat = trainer(model_dir, task, "rloo", 0, tree)
    bpo = trainer(model_dir, task, "bpo", 0, tree)
    kinds = {"evaluation": (flat, lambda: flat.rollout(task.tasks(task.eval_ids), rollout_n=1, estimator="grpo")),
             "tree": (bpo, lambda: bpo.rollout(task.tasks(task.train_ids)[:task.batch]))}
    full = {rl.client: rl.client.cache.max_tokens for rl, _ in kinds.values()}
    measured = {kind: {"cached": [], "uncached": []} for kind in kinds}
    worst, hits, lookups = 0.0, 0, 0
    for rl, run in kinds.values():  # untimed: the first rollout starts engine processes and warms the kernels
        run()
    for repeat in range(args.repeats):
        for kind, (rl, run) in kinds.items():
            for mode in ("cached", "uncached") if repeat % 2 == 0 else ("uncached", "cached"):
                rl.client.cache.max_tokens = full[rl.client] if mode == "cached" else 0
                before = (rl.client.cache.hits, rl.client.cache.hits + rl.client.cache.misses)
                rl.updates = repeat  # the same trees' seeds for both modes of a repeat
                wall, generate, results = timed_rollout(rl, run)
                measured[kind][mode].append((wall, generate))
                if mode == "cached":
                    hits += rl.client.cache.hits - before[0]
                    lookups += rl.client.cache.hits + rl.client.cache.misses - before[1]
                    worst = max(worst, max_log_prob_diff(rl, results))
                print(f"{kind} repeat {repeat} {mode:8s}: wall {wall:.1f} s, generate {generate:.1f} s", flush=True)
    result: dict = {"task": args.task, "repeats": args.repeats}
    for kind, modes in measured.items():
        mean = {mode: np.mean(np.array(v), axis=0) for mode, v in modes.items()}
        result[kind] = {
            "wall_s": {mode: round(float(m[0]), 2) for mode, m in mean.items()},
            "generate_s": {mode: round(float(m[1]), 2) for mode, m in mean.items()},
            "wall_cached_over_uncached": round(float(mean["cached"][0] / mean["uncached"][0]), 3),
            "generate_cached_over_uncached": round(float(mean["cached"][1] / mean["uncached"][1]), 3),
        }
    result.update(hit_share=round(hits / max(lookups, 1), 3), max_log_prob_diff=float(f"{worst:.3g}"),
                  wall_s=round(time.monotonic() - start))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
