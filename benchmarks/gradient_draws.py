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
  ``A``'s as the learning benchmark does (``grad_var_bpo_over_rloo``, CI95 bootstrap over draws), and the same
  ratio of ``tr Cov`` estimated as the median of 8 blocks' (``grad_var_mom_bpo_over_rloo``): one far batch can
  carry the plain ratio (on ``real_late``'s warm start one BPO batch held 85% of its ``tr Cov``), not this one;
* ``BPO_jittered`` (``--sets`` only): BPO's draws again with every sandbox step waiting a further 0-``--jitter-ms``
  ms on a worker thread (``learning.late_steps``; sandboxes that run in the drawing process, the signpost tasks):
  the same batches, if a tree depends only on its seeds and not on which branch's sandbox answered first.
* ``BPO_r4k2``, ``BPO_r2k4`` (``--sets`` only; signpost tasks whose door comes last): fixed shapes, to set the
  allocation model's ranking of shapes against the measurement: the fixed rule (N leaves) with K0 root paths (4, 2),
  each forked into K (2, 4) at depth ``length − 1``, the turn at which a walk without a wasted move stands at the
  doors. Each set's ``tr Cov`` × tokens per batch against ``A``'s is ``grad_var_<set>_over_rloo`` (with ``_ci95``),
  and ``predicted_<set>_over_rloo`` is what the allocation model says of the same ratio, from the depth profile that
  BPO's trees teach at the warm start; ``predicted_learned_over_rloo`` is the model's figure for the shape the
  learned allocation picks within RLOO's mean tokens (what set ``BPO`` grows, up to rounding, unspent budget, each
  task's own budget, and the tenth of its trees that take the exploration shape).

    python benchmarks/gradient_draws.py [--task real_early] [--draws 64] [--bpo] [--sets A BPO] [--workers 2]
        [--jitter-ms 20] [--saved FILE] [--out runs/learning]

``--sets`` draws only the sets named (``A`` and ``BPO`` suffice for the BPO/RLOO ratio); a statistic whose sets were
not drawn is left out. ``--saved FILE`` reads the named sets that ``FILE`` (a saved ``.npz`` of the same task and
draws, below) holds instead of drawing them again: the same seeds draw the same batches, so e.g. RLOO's ``A`` of an
earlier run serves a new set's ratio (its first draws can be checked against a short fresh run). The Gram matrices are
saved to ``OUT/gradient_draws_<task>_<draws>_<sets>.npz`` (one array per set, with its tokens per batch), so a
recorded set can be read again with another statistic without drawing it again.

Last line: one JSON object: per set the signal-to-noise with its CI95 (bootstrap over draws), ``tr Cov`` and its
median-of-blocks ``trace_cov_mom``, generated tokens per batch, the trees' mean ``bpo/leaf_mass_factor`` (L · Σ w²,
1 when every leaf weighs alike), and ``norm_sq_max_over_median`` (the largest draw's squared norm over the median's:
one draw far out would carry ``tr Cov`` and the signal-to-noise with it); with ``A`` and ``A_uncached``
``gram_max_rel_diff`` (``max |G_A − G_A_uncached| / max |G_A|``: 0 up to floating point when the draws reproduce,
target < 1e-3), with ``BPO`` and ``BPO_jittered`` the same for them (``jittered_gram_max_rel_diff``), with ``A`` and
``B`` ``snr_b_over_a`` and ``snr_cis_overlap``, with ``A`` and ``BPO`` ``grad_var_bpo_over_rloo`` and
``grad_var_mom_bpo_over_rloo`` with their CI95s (``grad_var_ci95``, ``grad_var_mom_ci95``), and ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from learning import (BENCHMARK_TASKS, GRAD_WARMUP, ROLLOUT_N, bootstrap, gradient_draws, signal_to_noise,
                      task_at_warm_start, trace_cov, trace_cov_median_of_means, trainer, tree_settings, variance_ratio,
                      worker_pool)

if TYPE_CHECKING:
    from verl_bpo.core.fork_policy import AllocationPlan
    from verl_bpo.core.profile import DepthProfile

SETS = {"A": {"estimator": "rloo", "seed": 0, "cache": True},
        "A_uncached": {"estimator": "rloo", "seed": 0, "cache": False},
        "B": {"estimator": "rloo", "seed": 1, "cache": True}}
BPO_SET = {"BPO": {"estimator": "bpo", "seed": 0, "cache": True}}
JITTERED_SET = {"BPO_jittered": {"estimator": "bpo", "seed": 0, "cache": True, "jittered": True}}
FIXED_SHAPES = {"BPO_r4k2": (4, 2), "BPO_r2k4": (2, 4)}  # K0 root paths, each forked into K where the door is
assert all(root * width == ROLLOUT_N for root, width in FIXED_SHAPES.values()), "a fixed shape grows N leaves"
FIXED_SETS = {name: {"estimator": "bpo", "seed": 0, "cache": True, "shape": shape}
              for name, shape in FIXED_SHAPES.items()}
PROFILE_BATCHES = 32  # BPO batches after its warm-up whose trees teach the profile of the model's predictions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="real_early", choices=list(BENCHMARK_TASKS))
    parser.add_argument("--draws", type=int, default=64)
    parser.add_argument("--bpo", action="store_true", help="also draw BPO's batch gradients (set BPO)")
    parser.add_argument("--sets", nargs="+", choices=[*SETS, *BPO_SET, *JITTERED_SET, *FIXED_SETS],
                        help="draw only these sets")
    parser.add_argument("--jitter-ms", type=float, default=20.0, help="the most a step of set BPO_jittered waits")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    parser.add_argument("--saved", type=Path, help="a saved .npz whose sets (of --draws draws) are read, not drawn")
    args = parser.parse_args()
    if args.bpo and args.sets:
        parser.error("--bpo adds BPO to the default sets; with --sets, name BPO among them instead")
    start = time.monotonic()
    every = {**SETS, **BPO_SET, **JITTERED_SET, **FIXED_SETS}
    names = args.sets or [*SETS, *(BPO_SET if args.bpo else ())]
    sets = {name: kw for name, kw in every.items() if name in names}
    shapes = {name: kw["shape"] for name, kw in sets.items() if "shape" in kw}
    if shapes and door_depth(BENCHMARK_TASKS[args.task]) is None:
        parser.error(f"--sets {' '.join(shapes)}: the fixed shapes fork where a signpost task's door comes last; "
                     f"--task {args.task} is not such a task")
    saved = saved_sets(args.saved, sets, args.task, args.draws) if args.saved else {}
    task, model_dir = task_at_warm_start(args.task, args.out.resolve())
    with worker_pool(args.workers) as pool:
        futures = {name: pool.submit(gradient_draws, model_dir, task, kw["estimator"], args.draws,
                                     GRAD_WARMUP if "shape" not in kw and kw["estimator"] == "bpo" else 0,
                                     tree_settings(), seed=kw["seed"], cache=kw["cache"],
                                     jitter_ms=args.jitter_ms if kw.get("jittered") else 0.0,
                                     bpo=fixed_shape(task, *kw["shape"]) if "shape" in kw else None)
                   for name, kw in sets.items() if name not in saved}
        predicted = pool.submit(predicted_over_rloo, model_dir, task, shapes) if shapes else None
        draws = {name: saved[name] if name in saved else futures[name].result() for name in sets}
        predicted = predicted.result() if predicted else {}
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / f"gradient_draws_{args.task}_{args.draws}_{'_'.join(sets)}.npz",
             **{name: gram for name, (gram, _, _) in draws.items()},
             **{f"{name}_tokens": tokens for name, (_, tokens, _) in draws.items()})
    result: dict = {"task": args.task, "draws": args.draws, "sets": sets, "read_from_saved": sorted(saved),
                    "saved": args.saved.name if args.saved else None}
    for name, (gram, tokens, mass_factor) in draws.items():
        snr, cov = signal_to_noise(gram), trace_cov(gram)
        norms = np.diag(gram)
        result[name] = {"snr": round(snr, 4), "snr_ci95": bootstrap(lambda i, g=gram: signal_to_noise(g, i), len(gram)),
                        "trace_cov": float(f"{cov:.4g}"),
                        "trace_cov_mom": float(f"{trace_cov_median_of_means(gram):.4g}"),
                        "tokens_per_batch": round(tokens, 1),
                        "leaf_mass_factor": None if mass_factor is None else round(mass_factor, 3),
                        "norm_sq_max_over_median": round(float(norms.max() / np.median(norms)), 2)}
        print(f"{name}: SNR {snr:.3f} CI95 {result[name]['snr_ci95']}, tr Cov {cov:.4g}", flush=True)
    for (first, second), key in {("A", "A_uncached"): "gram_max_rel_diff",
                                  ("BPO", "BPO_jittered"): "jittered_gram_max_rel_diff"}.items():
        if {first, second} <= sets.keys():
            g, h = draws[first][0], draws[second][0]
            result[key] = float(f"{np.abs(g - h).max() / np.abs(g).max():.3g}")
    if {"A", "B"} <= sets.keys():
        (lo_a, hi_a), (lo_b, hi_b) = result["A"]["snr_ci95"], result["B"]["snr_ci95"]
        result.update(snr_b_over_a=round(result["B"]["snr"] / result["A"]["snr"], 3),
                      snr_cis_overlap=bool(lo_a <= hi_b and lo_b <= hi_a))
    if {"A", "BPO"} <= sets.keys():
        for key, cov in (("grad_var", trace_cov), ("grad_var_mom", trace_cov_median_of_means)):
            var_ratio = variance_ratio(*draws["BPO"][:2], *draws["A"][:2], cov=cov)
            result[f"{key}_bpo_over_rloo"] = round(var_ratio(np.arange(args.draws)), 4)
            result[f"{key}_ci95"] = bootstrap(var_ratio, args.draws)
    if shapes:
        result["predicted_learned_over_rloo"] = round(predicted["learned"], 4)
    for name in shapes:
        result[f"predicted_{name}_over_rloo"] = round(predicted[name], 4)
        if "A" in sets:
            var_ratio = variance_ratio(*draws[name][:2], *draws["A"][:2], cov=trace_cov)
            result[f"grad_var_{name}_over_rloo"] = round(var_ratio(np.arange(args.draws)), 4)
            result[f"grad_var_{name}_over_rloo_ci95"] = bootstrap(var_ratio, args.draws)
    result["wall_s"] = round(time.monotonic() - start)
    print(json.dumps(result))


def saved_sets(path: Path, sets: dict, task: str, draws: int) -> dict[str, tuple[np.ndarray, float, float | None]]:
    """The sets of ``sets`` that the saved Gram matrices at ``path`` (drawn on ``task``, as its name says) hold, as
    :func:`gradient_draws` returns them (their leaf mass factor is not saved: ``None``)."""
    if not path.name.startswith(f"gradient_draws_{task}_"):
        raise SystemExit(f"--saved {path}: not drawn on --task {task} (its name is not gradient_draws_{task}_...)")
    saved = np.load(path)
    out = {}
    for name in sets:
        if name in saved.files:
            gram = saved[name]
            if gram.shape != (draws, draws):
                raise SystemExit(f"--saved {path}: set {name} holds {len(gram)} draws, not --draws {draws}")
            out[name] = (gram, float(saved[f"{name}_tokens"]), None)
    if not out:
        raise SystemExit(f"--saved {path}: holds none of the sets {', '.join(sets)} "
                         f"(it holds {', '.join(saved.files)})")
    return out


def door_depth(task) -> int | None:
    """The depth where a signpost ``task``'s door comes last (``length − 1``: the turn at which a walk without a
    wasted move stands at the doors); ``None`` for any other task."""
    config = task.sandbox_config
    if task.sandbox != "signpost" or config.get("decide_at", "end") != "end":
        return None
    return config["length"] - 1


def fixed_shape(task, root: int, width: int) -> dict:
    """The ``bpo:`` settings of a fixed shape on a signpost ``task``: ``root`` paths, each forked into ``width``
    at :func:`door_depth` (the fixed rule's one wave there forks them all: N leaves)."""
    # "learned": {} replaces the benchmark's learned settings, which the fixed rule would refuse as unread
    return {"allocation": "fixed", "min_depth": door_depth(task), "fixed": {"k0": root, "k": width}, "learned": {}}


def fixed_widths(task, root: int, width: int = 1) -> np.ndarray:
    """The allocation model's widths (:mod:`verl_bpo.core.shape`) of ``root`` paths, each forked into ``width`` at
    :func:`door_depth` (``root`` = N, ``width`` = 1: RLOO's flat group); signpost tasks whose door comes last."""
    door = door_depth(task)
    if door is None:
        raise ValueError(f"task {task.name} has no door at its last step: fixed shapes fork where a signpost's is")
    widths = np.ones(task.max_turns, dtype=np.int64)
    widths[0] = root
    widths[door] = width
    return widths


def learned_plan(model_dir: Path, task) -> tuple[AllocationPlan, DepthProfile]:
    """The learned allocation's plan at the warm start within RLOO's mean tokens (its ``shape``, the ``candidates``
    it searched), and the depth profile it comes from, which BPO's trees teach there in its warm-up and
    ``PROFILE_BATCHES`` more batches (the learned set's first batches: the same seeds)."""
    import random

    from verl_bpo.core.fork_policy import AllocationPlan
    from verl_bpo.core.shape import shape_cost

    rl = trainer(model_dir, task, "bpo", 0, tree_settings())
    tasks = task.tasks(task.train_ids)[:task.batch]
    for d in range(GRAD_WARMUP + PROFILE_BATCHES):
        rl.updates = d - GRAD_WARMUP
        rl.rollout(tasks)
    policy, n = rl.policies["bpo"], rl.config.rollout_n
    flat_tokens = float(shape_cost(fixed_widths(task, n)[None], policy.profile.per_sample_cost("tokens"))[0])
    return AllocationPlan(policy.config, n, policy.profile, random.Random(0), root_budget=flat_tokens), policy.profile


class Profile(NamedTuple):
    """What the allocation model prices a shape by, per depth: the return variance it credits to the depth, the
    gradient mass, and the generated tokens per sample."""

    credited: np.ndarray
    mass: np.ndarray
    per_sample: np.ndarray

    @classmethod
    def of(cls, profile: DepthProfile) -> Profile:
        """The model's view of a taught depth profile, in generated tokens."""
        return cls(profile.credited_variance(), profile.gradient_mass(), profile.per_sample_cost("tokens"))


def variance_over_flat(widths: np.ndarray, profile: Profile, flat: np.ndarray) -> np.ndarray:
    """The model's gradient variance of each row of ``widths`` ``(M, T)`` over ``flat``'s (RLOO: N root paths)."""
    from verl_bpo.core.shape import shape_variance

    return (shape_variance(widths, profile.credited, profile.mass)
            / shape_variance(flat[None], profile.credited, profile.mass)[0])


def cost_over_flat(widths: np.ndarray, profile: Profile, flat: np.ndarray) -> np.ndarray:
    """The generated tokens of each row of ``widths`` ``(M, T)`` over ``flat``'s."""
    from verl_bpo.core.shape import shape_cost

    return shape_cost(widths, profile.per_sample) / shape_cost(flat[None], profile.per_sample)[0]


def predicted_over_rloo(model_dir: Path, task, shapes: dict[str, tuple[int, int]]) -> dict[str, float]:
    """What the allocation model (:mod:`verl_bpo.core.shape`) predicts of each shape's gradient variance × generated
    tokens against RLOO's (N root paths), from the profile of :func:`learned_plan`, and of the learned shape."""
    plan, depth_profile = learned_plan(model_dir, task)
    profile, flat = Profile.of(depth_profile), fixed_widths(task, plan.rollout_n)
    widths = {"learned": plan.shape.widths, **{name: fixed_widths(task, *shape) for name, shape in shapes.items()}}
    rows = np.stack(list(widths.values()))
    ratios = variance_over_flat(rows, profile, flat) * cost_over_flat(rows, profile, flat)
    return {name: float(r) for name, r in zip(widths, ratios)}


if __name__ == "__main__":
    main()
