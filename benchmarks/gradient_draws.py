"""The learning benchmark's warm-start gradient draws: do they reproduce, and how far does their signal-to-noise move?

The qualification reports RLOO's batch signal-to-noise (``‖E ĝ‖² / tr Cov ĝ``) at seed 0's warm start from
``--grad-draws`` batch gradients (``benchmarks/learning.py``), and two draws of one warm start (``real_early``'s,
64 batches each) read 1.04 and 0.16. This draws RLOO's batch gradients at a task's warm start 0 three times, with
the learning benchmark's own ``gradient_draws``:

* ``A``: tree seed 0, the client's prefix cache on (what the learning benchmark draws);
* ``A_uncached``: the same tree seeds with the cache off: the same batches, if a draw depends only on its seeds and
  the cache changes nothing it samples (compared through the Gram matrices: every inner product between draws);
* ``B``: tree seed 1, the cache on: an independent set of as many draws;
* with ``--bpo``, ``BPO``: tree seed 0, the cache on, as many draws of BPO's batch gradient (``allocation=learned``
  after the learning benchmark's warm-up batches), whose ``tr Cov`` × generated tokens per batch is set against
  ``A``'s as the learning benchmark does (``grad_var_bpo_over_rloo``, CI95 bootstrap over draws).

    python benchmarks/gradient_draws.py [--task real_early] [--draws 64] [--bpo] [--workers 2] [--out runs/learning]

Last line: one JSON object: per set the signal-to-noise with its CI95 (bootstrap over draws), ``tr Cov``,
generated tokens per batch, and ``norm_sq_max_over_median`` (the largest draw's squared norm over the median's: one
draw far out would carry ``tr Cov`` and the signal-to-noise with it); ``gram_max_rel_diff``
(``max |G_A − G_A_uncached| / max |G_A|``: 0 up to floating point when the draws reproduce, target < 1e-3),
``snr_b_over_a``, ``snr_cis_overlap``, with ``--bpo`` ``grad_var_bpo_over_rloo`` and its ``grad_var_ci95``, and
``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from learning import (BENCHMARK_TASKS, GRAD_WARMUP, bootstrap, gradient_draws, signal_to_noise, task_at_warm_start,
                      trace_cov, tree_settings, variance_ratio, worker_pool)

SETS = {"A": {"estimator": "rloo", "seed": 0, "cache": True},
        "A_uncached": {"estimator": "rloo", "seed": 0, "cache": False},
        "B": {"estimator": "rloo", "seed": 1, "cache": True}}
BPO_SET = {"BPO": {"estimator": "bpo", "seed": 0, "cache": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="real_early", choices=list(BENCHMARK_TASKS))
    parser.add_argument("--draws", type=int, default=64)
    parser.add_argument("--bpo", action="store_true", help="also draw BPO's batch gradients (set BPO)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    args = parser.parse_args()
    start = time.monotonic()
    task, model_dir = task_at_warm_start(args.task, args.out.resolve())
    sets = {**SETS, **(BPO_SET if args.bpo else {})}
    with worker_pool(args.workers) as pool:
        futures = {name: pool.submit(gradient_draws, model_dir, task, kw["estimator"], args.draws,
                                     GRAD_WARMUP if kw["estimator"] == "bpo" else 0, tree_settings(), seed=kw["seed"],
                                     cache=kw["cache"])
                   for name, kw in sets.items()}
        grams = {name: future.result() for name, future in futures.items()}
    result: dict = {"task": args.task, "draws": args.draws, "sets": sets}
    for name, (gram, tokens) in grams.items():
        snr = signal_to_noise(gram)
        norms = np.diag(gram)
        result[name] = {"snr": round(snr, 4), "snr_ci95": bootstrap(lambda i, g=gram: signal_to_noise(g, i), len(gram)),
                        "trace_cov": float(f"{trace_cov(gram):.4g}"), "tokens_per_batch": round(tokens, 1),
                        "norm_sq_max_over_median": round(float(norms.max() / np.median(norms)), 2)}
        print(f"{name}: SNR {snr:.3f} CI95 {result[name]['snr_ci95']}, tr Cov {trace_cov(gram):.4g}", flush=True)
    a, a_uncached = grams["A"][0], grams["A_uncached"][0]
    (lo_a, hi_a), (lo_b, hi_b) = result["A"]["snr_ci95"], result["B"]["snr_ci95"]
    result.update(gram_max_rel_diff=float(f"{np.abs(a - a_uncached).max() / np.abs(a).max():.3g}"),
                  snr_b_over_a=round(result["B"]["snr"] / result["A"]["snr"], 3),
                  snr_cis_overlap=bool(lo_a <= hi_b and lo_b <= hi_a))
    if args.bpo:
        var_ratio = variance_ratio(*grams["BPO"], *grams["A"])
        result.update(grad_var_bpo_over_rloo=round(var_ratio(np.arange(args.draws)), 4),
                      grad_var_ci95=bootstrap(var_ratio, args.draws))
    result["wall_s"] = round(time.monotonic() - start)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
