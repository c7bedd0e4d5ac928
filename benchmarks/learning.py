"""The paper's learning claims, measured: BPO vs GRPO vs RLOO trained at matched generated tokens per update.

Tasks: the embedded ones (``verl_bpo.demo.tasks.TASKS``) and the real-engine ones ``real_late`` / ``real_early`` and
``real_late_exit`` (``verl_bpo.demo.textworld_tasks``: generated TextWorld games on the real engine, made under
``--out`` on first use). The reference pair, ``late`` — the signpost corridor, where routine moves come first and the
one decisive choice last — and ``early`` — the same corridor with the choice first, so the first move decides and the
walk after it only reveals the outcome — is step-bound at its learning rate (RLOO with twice the rollouts takes exactly
RLOO's updates), so it cannot test a variance claim; it stays as the reference (``--tasks late early``). The real-engine
tasks are opt-in (``--tasks real_late real_early real_late_exit``): no control of theirs has qualified (README), and
with them the default run would outgrow two hours on two cores (their warm starts know the training games' routes and do
not carry to unseen ones, so they evaluate on their training games). The default run covers the other tasks,
``hard_late`` and ``hard_early``.
Each task sets its batch (tasks per update), its updates per run and its trained response length.

For each task and seed, every estimator trains from the same warm start on the same task order with
:class:`verl_bpo.local.trainer.LocalRL` (the real tree sampler, verl's estimator registry and policy loss with the
arguments verl's actor passes; an in-process policy and optimizer instead of vLLM and FSDP, so that several seeds fit on
a CPU box). Each seed has its own warm start (``--warm-starts per-seed``, the default: seed s trains from
``task_model(..., seed=s)``, the same recipe on other demonstrations), so the paired bootstrap over seeds spans warm
starts as well as training draws: with one warm start for every seed (``--warm-starts one``, the records before
2026-12-06) the qualification verdict moved from one box to another, because each box's floating point trains another
warm start. Matched compute: GRPO and RLOO take N = 8 independent rollouts per task; BPO grows one tree per task with
``bpo.allocation=learned`` and ``bpo.learned.budget_unit=tokens``, up to ``--max-leaves`` leaves. Its tree's token
budget is, by default (``--match grpo``), exactly the tokens GRPO's group generated on the same task at the same update
of the same seed (GRPO trains first), so BPO and GRPO are matched in generated tokens per update throughout training,
not only at the warm start; ``--match rloo`` pairs with RLOO instead, and ``--match own`` gives each tree what N flat
rollouts of BPO's own policy would generate, learned from its earlier trees (the tokens then follow each estimator's
policy and are matched at the warm start only). Every update has the same tasks, learning rate (the task's, or ``--lr``)
and one AdamW step (``eps`` 1e-5, ``--adam-eps``: with torch's 1e-8 single updates break the warm start's format for
every estimator, ``benchmarks/first_updates.py``).

**Qualification, fixed before any BPO run.** A task counts for the claims only if it is noise-limited, shown by the
control alone. Per task, the control trains first: for every seed RLOO and RLOO with 2N rollouts per task (exactly
half RLOO's gradient variance per update, at twice its tokens). The task is *qualified* when RLOO-2N reaches the
target in at most ``QUALIFY_MAX_RATIO`` = 0.75× RLOO's updates **and** the upper end of that ratio's CI95 is below
1.0 (:func:`qualification`: the ratio of the seeds' mean updates to target, paired bootstrap over seeds, a censored
seed counted as updates + ``--eval-every``). Near 1, progress per update is bounded by the optimizer's step, not by
gradient noise, and no estimator with less variance could take fewer updates. RLOO's batch signal-to-noise at seed
0's warm start (``‖E ĝ‖² / tr Cov ĝ``) is reported beside it, with its CI95. The verdict is printed before GRPO and
BPO train; the targets apply only to qualified tasks, and tasks that fail the rule are reported too.

Measured, per task, seed and estimator:

* **success curve** — every ``--eval-every`` updates, the success rate of ``--eval-episodes`` independent sampled
  episodes on each evaluation task (task ids never trained on, except the real-engine tasks': their training games,
  in episodes of their own; the same tasks and sandbox seeds for every estimator);
* **updates to target** — the first evaluated update whose success reaches the task's target (a seed that never
  does counts as updates + ``--eval-every``, stated as censored);
* **tokens to target** — the generated tokens spent until then (a censored seed at its mean rate per update): the
  comparison at matched generated tokens with the estimator BPO is not paired with (and under ``--match own``);
* **final success** — the mean of the last two evaluations;
* **success at matched tokens** — per seed, each run's success once it has generated as many tokens as the run
  that generated least over its updates (interpolated between evaluations): the end of training at matched
  generated tokens;
* **gradient variance at matched tokens** — at seed 0's warm-start policy, ``--grad-draws`` independent batches per
  estimator (BPO after ``--grad-warmup`` batches that teach its profile): tr Cov(ĝ) × generated tokens per batch,
  BPO over RLOO (both unbiased and on one scale), and each batch gradient's signal-to-noise;
* **costs per update**, per estimator (RLOO-2N included): generated tokens, environment steps, trainer rows, and
  trained tokens in two layouts — ``leaf`` (one row per leaf, prompt + response: verl's layout, what the baselines
  train) and ``packed`` (each tree as one row of its unique tokens, ``bpo.packed``; a flat group packs to its
  shared prompt plus every response).

95% confidence intervals: paired bootstrap over seeds (learning), bootstrap over draws (variance and
signal-to-noise).

    python benchmarks/learning.py [--tasks ...] [--seeds 6] [--updates N] [--match grpo] [--warm-starts per-seed]
                                   [--out runs/learning]

(``--updates``: default each task's own.) The control's runs are saved under ``--out`` (``control_<task>.json``);
``--reuse-control`` takes them into a later run with the same ``--out`` and settings (checked), so a task is
qualified once (``--control-only``) and its GRPO and BPO runs come after the verdict; with more ``--seeds`` than were
saved it trains only the seeds the save lacks and saves them all (a control grows from three seeds to six).

Last line: one JSON object with, per task prefix (``<task>_``): ``qualified`` (true/false, the rule above),
``snr_rloo``, ``updates_to_target_rloo_2n_over_rloo``, ``final_success_rloo_2n_minus_rloo``, ``qualification`` (the
rule, the ratio, its CI, the seeds' updates, and RLOO's signal-to-noise with its CI95 ``snr_rloo_ci95``),
``updates_to_target_bpo_over_grpo``, ``tokens_to_target_bpo_over_grpo``, ``final_success_bpo_minus_grpo``,
``final_success_bpo_minus_rloo``, ``success_at_matched_tokens_bpo_minus_grpo`` (and ``_rloo``),
``grad_var_bpo_over_rloo``, their ``ci95``, ``per_update`` costs and pre-clip gradient norm per estimator,
``wall_s_per_run`` (per estimator, each seed's run: its updates and held-out evaluations, two runs at a time),
``curves`` (each seed's held-out success at ``curve_updates``),
``fallen_seeds`` (per estimator, the runs that fell to no success after a warm start that had some; they stay in every
figure, see ``fallen``), and ``targets``: on a qualified task each target with its value and ``met``, otherwise ``"not
applicable: task not noise-limited"``. Targets (the paper's): on late-decision forms (``late``, ``hard_late``,
``real_late``) updates to target BPO/GRPO <= 0.62, final success BPO - GRPO >= +0.036, gradient variance BPO/RLOO <=
0.5; on early-decision forms (``*early``) final success BPO - RLOO >= -0.02 (a tie).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from verl_bpo.demo.tasks import TASKS, DemoTask, task_model
from verl_bpo.demo.textworld_tasks import TEXTWORLD_TASKS, textworld_task_model, with_games

if TYPE_CHECKING:  # torch loads only when a run trains (the summary and its tests need no model)
    from verl_bpo.local.trainer import LocalRL

ESTIMATORS = ("bpo", "grpo", "rloo")
BASELINES = ("grpo", "rloo")
CONTROL = "rloo_2n"  # RLOO with 2N rollouts per task: half RLOO's variance per update, twice its tokens
REFERENCE_TASKS = ("late", "early")  # step-bound at their learning rate: the reference, not the default run
BENCHMARK_TASKS = {**TASKS, **TEXTWORLD_TASKS}  # the embedded tasks and the real-engine ones
# Not in the default run until their control has run (calibration first: textworld_tasks' docstring).
OPT_IN_TASKS = tuple(TEXTWORLD_TASKS)
ROLLOUT_N, MAX_TOKENS_PER_TURN = 8, 6
ADAM_EPS = 1e-5  # torch's 1e-8 lets single updates break the warm start (benchmarks/first_updates.py)
MAX_LEAVES, BPO_WARMUP_TREES = 32, 8  # the defaults of --max-leaves and --bpo-warmup-trees
GRAD_WARMUP = 4  # the default of --grad-warmup: BPO batches that teach its profile before its gradients are drawn
QUALIFY_MAX_RATIO = 0.75  # RLOO-2N's updates to target over RLOO's at most this (and its CI95 below 1) to qualify
QUALIFY_RULE = (f"RLOO-2N updates to target / RLOO's <= {QUALIFY_MAX_RATIO} and its upper CI95 < 1.0 "
                "(paired bootstrap over seeds; a censored seed counts as updates + eval_every)")
NOT_QUALIFIED = "not applicable: task not noise-limited"
# The paper's targets: key -> (comparison, bound), by where the task's decision sits.
TARGETS = {
    "late": {"updates_to_target_bpo_over_grpo": ("<=", 0.62), "final_success_bpo_minus_grpo": (">=", 0.036),
             "grad_var_bpo_over_rloo": ("<=", 0.5)},
    "early": {"final_success_bpo_minus_rloo": (">=", -0.02)},
}
COSTS = ("generated_tokens", "env_steps", "trainer_rows", "trained_tokens_leaf", "trained_tokens_packed")
TRAINED_TOKENS_LAYOUT = ("trained_tokens_leaf: one row per leaf (prompt + response; verl's layout, what the baselines "
                         "train); trained_tokens_packed: each tree as one row of its unique tokens (bpo.packed; a "
                         "flat group shares only its prompt)")


def default_tasks() -> list[str]:
    """Every task but the step-bound reference pair and the opt-in real-engine tasks."""
    return [name for name in BENCHMARK_TASKS if name not in (*REFERENCE_TASKS, *OPT_IN_TASKS)]


def runnable(task: DemoTask, out: Path, batch: int | None = None) -> DemoTask:
    """``task`` as the benchmark trains it under ``out``: ``batch`` tasks per update (default: the task's), and a
    real-engine task naming its games (generated under ``out``)."""
    task = dataclasses.replace(task, batch=batch or task.batch)
    return with_games(task, out) if task.name in TEXTWORLD_TASKS else task


def warm_start_model(out: Path, task: DemoTask, seed: int = 0) -> Path:
    """Warm start ``seed`` of ``task`` under ``out`` (a real-engine task generates its games first)."""
    return (textworld_task_model if task.name in TEXTWORLD_TASKS else task_model)(out, task, seed)


def task_at_warm_start(name: str, out: Path) -> tuple[DemoTask, Path]:
    """Task ``name`` as the benchmark trains it under ``out``, and its warm start 0 (built when missing): where the
    diagnostics start."""
    task = runnable(BENCHMARK_TASKS[name], out)
    return task, warm_start_model(out, task)


def task_form(name: str) -> str | None:
    """``late`` or ``early``: where the task's decision sits (its targets), from a word of its name (``hard_late``,
    ``real_late_exit``, ...)."""
    return next((form for form in TARGETS if form in name.split("_")), None)


def bpo_block(task: DemoTask, estimator: str, tree: dict, extra: dict | None = None) -> dict:
    """The ``bpo:`` block; ``tree`` holds the BPO tree's own settings from the command line, ``extra`` top-level
    settings that replace the benchmark's (diagnostics)."""
    block = {"max_turns": task.max_turns, "max_tokens_per_turn": MAX_TOKENS_PER_TURN}
    if estimator == "bpo":
        block.update(allocation="learned", learned={"budget_unit": "tokens", "explore_share": 0.1, **tree})
    return {**block, **(extra or {})}


def tree_settings(max_leaves: int = MAX_LEAVES, warmup_trees: int = BPO_WARMUP_TREES) -> dict:
    return {"max_leaves": max_leaves, "warmup_trees": warmup_trees}


def task_order(task: DemoTask, seed: int) -> list[dict[str, int]]:
    """The training tasks in the order a seed trains on them, the same for every estimator."""
    return random.Random(seed).sample(task.tasks(task.train_ids), len(task.train_ids))


def update_batch(order: list[dict[str, int]], update: int, batch: int) -> list[dict[str, int]]:
    """The ``batch`` tasks of one update."""
    return [order[(update * batch + j) % len(order)] for j in range(batch)]


def warm_start_batches(rl: LocalRL, task: DemoTask, seed: int, batches: int, warmup: int) -> Iterator[list]:
    """The rollouts (one tree per task) of ``batches`` task batches in the seed's training order at ``rl``'s
    weights, which never change, after ``warmup`` batches that only teach BPO's profile; each batch a fresh tree
    seed (the diagnostics' draws)."""
    order = task_order(task, seed)
    for b in range(warmup + batches):
        rl.updates = b
        results = rl.rollout(update_batch(order, b, task.batch))
        if b >= warmup:
            yield results


def trainer(model_dir: Path, task: DemoTask, estimator: str, seed: int, tree: dict,
            adam_eps: float = ADAM_EPS, lr: float | None = None, rollout_n: int = ROLLOUT_N,
            bpo: dict | None = None) -> LocalRL:
    """The learning benchmark's trainer for ``estimator`` on ``task``; ``bpo``: settings of the ``bpo:`` block on
    top of the benchmark's (diagnostics)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_bpo.local.trainer import LocalRL, LocalRLConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LocalRLConfig(estimator=estimator, rollout_n=rollout_n, batch_size=task.batch, lr=lr or task.lr,
                           adam_eps=adam_eps, response_length=task.response_length,
                           bpo=bpo_block(task, estimator, tree, bpo))
    return LocalRL(model, AutoTokenizer.from_pretrained(model_dir), task.sandbox, task.sandbox_config, config,
                   seed=seed)


def train_one(model_dir: Path, task: DemoTask, estimator: str, seed: int, args: argparse.Namespace, updates: int,
              budgets: list[list[float]] | None = None, rollout_n: int = ROLLOUT_N) -> dict:
    """One training run of ``updates`` updates; ``budgets[u]``: the token budget of each task's tree at update
    ``u`` (BPO at matched tokens), ``None``: learned from the run's own earlier trees."""
    t0 = time.monotonic()
    rl = trainer(model_dir, task, estimator, seed, tree_settings(args.max_leaves, args.bpo_warmup_trees),
                 args.adam_eps, args.lr, rollout_n)
    order = task_order(task, seed)
    evals = task.tasks(task.eval_ids)
    curve, steps = [(0, rl.evaluate(evals, args.eval_episodes))], []
    for u in range(updates):
        steps.append(rl.step(update_batch(order, u, task.batch), None if budgets is None else budgets[u]).__dict__)
        if (u + 1) % args.eval_every == 0:
            curve.append((u + 1, rl.evaluate(evals, args.eval_episodes)))
    return {"curve": curve, "steps": steps, "wall_s": round(time.monotonic() - t0, 1)}


def gradient_draws(model_dir: Path, task: DemoTask, estimator: str, draws: int, warmup: int,
                   tree: dict, seed: int = 0, cache: bool = True, jitter_ms: float = 0.0, bpo: dict | None = None
                   ) -> tuple[np.ndarray, float, float]:
    """The Gram matrix of ``draws`` batch gradients at the warm-start policy, the mean tokens per batch, and the
    trees' mean ``bpo/leaf_mass_factor`` (1 for flat groups).
    ``seed`` seeds the draws' trees (the same seed draws the same batches); ``cache``: the
    client's prefix cache on (off: every turn prefills its whole chat); ``jitter_ms``: each sandbox step waits a
    further 0-``jitter_ms`` ms on a worker thread (:func:`late_steps`); ``bpo``: settings of the ``bpo:`` block on
    top of the benchmark's (:func:`trainer`)."""
    rl = trainer(model_dir, task, estimator, seed, tree, bpo=bpo)
    if not cache:
        rl.client.cache.max_tokens = 0
    tasks = task.tasks(task.train_ids)[:task.batch]
    rows, tokens, mass_factors = [], [], []
    with late_steps(task.sandbox, jitter_ms) if jitter_ms > 0 else contextlib.nullcontext():
        for d in range(warmup + draws):
            # A fresh tree seed per draw (the weights never change); measured draw k takes update k's seeds whatever
            # the warm-up, so that BPO's and RLOO's draw k share their common random numbers and pair in the
            # bootstrap.
            rl.updates = d - warmup
            results = rl.rollout(tasks)
            if d < warmup:  # BPO's profile learns from these trees; they are not measured
                continue
            rl.gradient(results)
            rows.append(rl.flat_gradient())
            tokens.append(sum(r.metrics["bpo/generated_tokens"] for r in results))
            mass_factors += [r.metrics["bpo/leaf_mass_factor"] for r in results]
    return gram_matrix(rows), float(np.mean(tokens)), float(np.mean(mass_factors))


@contextlib.contextmanager
def late_steps(sandbox: str, jitter_ms: float, seed: int = 0) -> Iterator[None]:
    """While inside, every step of sandbox ``sandbox`` waits a further 0-``jitter_ms`` ms (uniform, from ``seed``'s
    generator) and runs on a worker thread, as a slow engine's steps do, so concurrent branches answer in another
    order: a diagnostic that the draws do not follow latencies. It patches the sandbox class in this process, so it
    reaches sandboxes that run here (the signpost tasks), not those in engine processes."""
    from sandbox_adapters.registry import get_sandbox_cls

    cls = get_sandbox_cls(sandbox)
    own = {name: cls.__dict__[name] for name in ("step", "blocking") if name in cls.__dict__}
    step, rng = cls.step, random.Random(seed)

    def late_step(self, action_text):
        time.sleep(rng.uniform(0.0, jitter_ms / 1000))
        return step(self, action_text)

    cls.step, cls.blocking = late_step, True
    try:
        yield
    finally:
        for name in ("step", "blocking"):
            if name in own:
                setattr(cls, name, own[name])
            else:
                delattr(cls, name)


def gram_matrix(rows: Sequence[np.ndarray]) -> np.ndarray:
    """Every inner product between the gradient draws ``rows`` (float32 as the model gives them), in float64."""
    g = np.stack(rows).astype(np.float64)
    return g @ g.T


def trace_cov(gram: np.ndarray, idx: np.ndarray | None = None) -> float:
    """tr Cov of the draws ``idx`` from their Gram matrix: Σ‖ĝ_i − ḡ‖² = Σ‖ĝ_i‖² − n‖ḡ‖² (a bootstrap resample
    costs O(draws²), not O(draws × parameters))."""
    idx = np.arange(len(gram)) if idx is None else idx
    sub = gram[np.ix_(idx, idx)]
    n = len(idx)
    return (float(np.trace(sub)) - float(sub.sum()) / n) / (n - 1)


def trace_cov_median_of_means(gram: np.ndarray, idx: np.ndarray | None = None, blocks: int = 8) -> float:
    """tr Cov of the draws ``idx`` as the median of its estimates on ``blocks`` consecutive blocks of them: one far
    draw moves a single block's estimate, not the median, where it can carry the plain :func:`trace_cov` (a
    heavy-tailed batch gradient). Not the mean: the median of a right-skewed block estimate sits below it, so only
    ratios of two sets of like tails read alike. Blocks hold at least 2 draws (fewer blocks when draws are few)."""
    idx = np.arange(len(gram)) if idx is None else np.asarray(idx)
    if len(idx) < 2:
        return float("nan")
    blocks = max(1, min(blocks, len(idx) // 2))
    return float(np.median([trace_cov(gram, block) for block in np.array_split(idx, blocks)]))


def signal_to_noise(gram: np.ndarray, idx: np.ndarray | None = None) -> float:
    """‖E ĝ‖² / tr Cov(ĝ) of one batch gradient, from the draws' Gram matrix (‖E ĝ‖² estimated without bias by the
    mean inner product of distinct draws): below 1, a batch's noise outweighs its signal. ``idx``: a resample of
    the draws (bootstrap), whose pairs of one draw with itself do not count as distinct."""
    idx = np.arange(len(gram)) if idx is None else np.asarray(idx)
    distinct = idx[:, None] != idx[None, :]
    if not distinct.any():
        return float("nan")
    mean_sq = float(gram[np.ix_(idx, idx)][distinct].mean())
    noise = trace_cov(gram, idx)
    return mean_sq / noise if noise > 0 else float("nan")  # every draw alike (e.g. all zero: returns tied)


def bootstrap(stat, n: int, reps: int = 2000, seed: int = 0) -> list[float]:
    """CI95 of ``stat`` over ``reps`` resamples of ``n`` indices; resamples where it is undefined (NaN: a ratio
    over zero, e.g. every draw the same one) are left out."""
    rng = np.random.default_rng(seed)
    values = np.array([stat(rng.integers(0, n, n)) for _ in range(reps)], dtype=float)
    values = values[~np.isnan(values)]
    if not len(values):
        return [float("nan"), float("nan")]
    return [round(float(np.percentile(values, 2.5)), 4), round(float(np.percentile(values, 97.5)), 4)]


def variance_ratio(gram_b: np.ndarray, tokens_b: float, gram_r: np.ndarray, tokens_r: float, cov=trace_cov):
    """The statistic tr Cov × tokens per batch of the draws ``i``, BPO's over RLOO's (NaN where RLOO's is 0);
    ``cov`` estimates tr Cov (:func:`trace_cov_median_of_means` for the robust form)."""

    def stat(i: np.ndarray) -> float:
        den = cov(gram_r, i) * tokens_r
        return cov(gram_b, i) * tokens_b / den if den else float("nan")

    return stat


def ratio_of_means(a: np.ndarray, b: np.ndarray):
    """The paired statistic ``mean(a[i]) / mean(b[i])`` of the seeds ``i`` (NaN where ``b``'s mean is 0)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)

    def stat(i: np.ndarray) -> float:
        den = b[i].mean()
        return float(a[i].mean() / den) if den else float("nan")

    return stat


def updates_to_target(run: dict, target: float, censored: int) -> int:
    """The first evaluated update whose success reaches ``target``; ``censored`` when none does."""
    return next((u for u, s in run["curve"] if s >= target), censored)


def qualification(reach_control, reach_rloo, gram_rloo: np.ndarray | None = None) -> dict:
    """The qualification rule (module docstring), from the control alone: per seed (paired by index), the updates
    to target of RLOO with 2N rollouts and of RLOO (censored seeds already counted as updates + eval_every).
    Qualified when ``mean(2N) / mean(RLOO) <= QUALIFY_MAX_RATIO`` and the upper end of its paired-bootstrap CI95 is
    below 1.0. ``gram_rloo``: the Gram matrix of RLOO's warm-start batch gradients, for the signal-to-noise
    reported beside the verdict (with its CI95, bootstrap over draws)."""
    reach_control, reach_rloo = np.asarray(reach_control, dtype=float), np.asarray(reach_rloo, dtype=float)
    if reach_control.shape != reach_rloo.shape or reach_rloo.ndim != 1 or not len(reach_rloo):
        raise ValueError("qualification needs the same seeds, at least one, for RLOO-2N and RLOO")
    stat = ratio_of_means(reach_control, reach_rloo)
    ratio = stat(np.arange(len(reach_rloo)))
    ci = bootstrap(stat, len(reach_rloo))
    qualified = bool(ratio <= QUALIFY_MAX_RATIO and ci[1] < 1.0)  # NaN (RLOO at the target from the start): False
    snr = None if gram_rloo is None else round(signal_to_noise(gram_rloo), 4)
    snr_ci = None if gram_rloo is None else bootstrap(lambda i: signal_to_noise(gram_rloo, i), len(gram_rloo))
    return {"qualified": qualified, "rule": QUALIFY_RULE, "max_ratio": QUALIFY_MAX_RATIO,
            "updates_to_target_rloo_2n_over_rloo": round(ratio, 4), "ci95": ci,
            "updates_to_target": {CONTROL: [int(u) for u in reach_control], "rloo": [int(u) for u in reach_rloo]},
            "snr_rloo": snr, "snr_rloo_ci95": snr_ci}


def evaluate_targets(name: str, stats: dict, qualified: bool) -> dict | str:
    """Each of the task form's targets with its value and whether it is met; only on a qualified task."""
    if not qualified:
        return NOT_QUALIFIED
    form = task_form(name)
    if form is None:
        return "none: neither a late- nor an early-decision task"
    out = {}
    for key, (op, bound) in TARGETS[form].items():
        value = stats[key]
        met = value <= bound if op == "<=" else value >= bound
        out[key] = {"target": f"{op} {bound:+g}" if op == ">=" else f"{op} {bound:g}", "value": value,
                    "met": bool(met)}
    return out


def tokens_per_update(run: dict, batch: int) -> list[float]:
    """Generated tokens of each update of a run (its steps record the mean per tree; ``batch`` trees per update)."""
    return [s["generated_tokens"] * batch for s in run["steps"]]


def tokens_until(run: dict, update: int, batch: int) -> float:
    """Generated tokens of a run's first ``update`` updates; past its last update (censored), its mean rate."""
    per_update = tokens_per_update(run, batch)
    if update <= len(per_update):
        return float(sum(per_update[:update]))
    return float(np.mean(per_update)) * update


def success_at_tokens(run: dict, tokens: float, batch: int) -> float:
    """A run's held-out success once it has generated ``tokens``, interpolated linearly between evaluations."""
    spent = np.concatenate([[0.0], np.cumsum(tokens_per_update(run, batch))])
    return float(np.interp(tokens, [spent[u] for u, _ in run["curve"]], [s for _, s in run["curve"]]))


def fallen(run: dict) -> bool:
    """Whether a run fell: an evaluation after its warm start read no success at all where the warm start read
    some (the collapse to a never-winning policy that a few runs show; which run falls is a draw, so the summary
    counts them per estimator).

    The rule, fixed before any comparison that follows it: a fallen run stays in every figure as it ran (its updates
    to target censored if it never got there, its final success as measured). A collapse is an outcome of the
    estimator that trained it; leaving it out would favour the estimator that falls more. ``fallen_seeds`` lets a
    reader see whether a difference comes from them."""
    start, *later = [s for _, s in run["curve"]]
    return start > 0 and any(s == 0 for s in later)


def summarize(name: str, runs: dict, grads: dict, *, target: float, updates: int, eval_every: int,
              batch: int) -> dict:
    """One task's summary from plain data (no model): ``runs``: estimator (``bpo``, ``grpo``, ``rloo``,
    ``rloo_2n``) -> per seed ``{"curve": [(update, success), ...], "steps": [step dicts]}`` (a step dict holds
    :class:`~verl_bpo.local.trainer.StepStats`' fields, per tree); ``grads``: ``{"bpo": (gram, tokens per batch,
    ...), "rloo": (...)}`` at the warm start (:func:`gradient_draws`' values; the first two are read); ``name`` picks
    the targets (:data:`TARGETS`); ``updates``, ``eval_every`` and ``batch`` as the runs trained."""
    seeds = {e: len(r) for e, r in runs.items()}
    if set(runs) != {*ESTIMATORS, CONTROL} or len(set(seeds.values())) != 1:
        raise ValueError(f"summarize needs the same seeds of {(*ESTIMATORS, CONTROL)}, got {seeds}")
    n = seeds["rloo"]
    censored = updates + eval_every
    reach = {e: np.array([updates_to_target(r, target, censored) for r in runs[e]]) for e in runs}
    # BPO's budgets match its paired baseline's tokens per update, not the other's (nor anyone's under --match own),
    # and a tree may leave some of its budget unspent, so the generated tokens spent to reach the target are
    # reported next to the updates.
    reach_tokens = {e: np.array([tokens_until(r, u, batch) for r, u in zip(runs[e], reach[e])]) for e in ESTIMATORS}
    # Success at matched generated tokens: per seed, where the run that generated least stopped (the control, which
    # spends twice RLOO's tokens, never sets it).
    least = [min(tokens_until(runs[e][s], updates, batch) for e in ESTIMATORS) for s in range(n)]
    matched = {e: np.array([success_at_tokens(r, t, batch) for r, t in zip(runs[e], least)]) for e in ESTIMATORS}
    final = {e: np.array([np.mean([s for _, s in r["curve"][-2:]]) for r in runs[e]]) for e in runs}
    (gram_b, tok_b), (gram_r, tok_r) = grads["bpo"][:2], grads["rloo"][:2]
    draws = len(gram_b)
    if len(gram_r) != draws:
        raise ValueError("the BPO and RLOO gradient draws must be as many (their variance ratio resamples both)")
    qual = qualification(reach[CONTROL], reach["rloo"], gram_r)

    var_ratio = variance_ratio(gram_b, tok_b, gram_r, tok_r)

    def minus(stat: dict, a: str, b: str):
        return lambda i: stat[a][i].mean() - stat[b][i].mean()

    # Statistics of the seeds ``i``: one formula gives each key its point estimate (all seeds) and paired CI.
    paired = {
        "updates_to_target_bpo_over_grpo": ratio_of_means(reach["bpo"], reach["grpo"]),
        "tokens_to_target_bpo_over_grpo": ratio_of_means(reach_tokens["bpo"], reach_tokens["grpo"]),
        "final_success_bpo_minus_grpo": minus(final, "bpo", "grpo"),
        "final_success_bpo_minus_rloo": minus(final, "bpo", "rloo"),
        "success_at_matched_tokens_bpo_minus_grpo": minus(matched, "bpo", "grpo"),
        "success_at_matched_tokens_bpo_minus_rloo": minus(matched, "bpo", "rloo"),
        "final_success_rloo_2n_minus_rloo": minus(final, CONTROL, "rloo"),
    }
    stats = {k: round(float(stat(np.arange(n))), 4) for k, stat in paired.items()}
    stats["grad_var_bpo_over_rloo"] = round(var_ratio(np.arange(draws)), 4)
    stats["updates_to_target_rloo_2n_over_rloo"] = qual["updates_to_target_rloo_2n_over_rloo"]
    return {
        "qualified": qual["qualified"],
        "snr_rloo": qual["snr_rloo"],
        **stats,
        "ci95": {**{k: bootstrap(stat, n) for k, stat in paired.items()},
                 "grad_var_bpo_over_rloo": bootstrap(var_ratio, draws),
                 "snr_rloo": qual["snr_rloo_ci95"],
                 "updates_to_target_rloo_2n_over_rloo": qual["ci95"]},
        "qualification": qual,
        "targets": evaluate_targets(name, stats, qual["qualified"]),
        "target_success": target,
        "seeds": n,
        "updates_to_target": {e: reach[e].tolist() for e in runs},
        "censored_at": censored,
        "tokens_to_target": {e: [round(float(v)) for v in reach_tokens[e]] for e in ESTIMATORS},
        "matched_tokens": [round(t) for t in least],
        "success_at_matched_tokens": {e: [round(float(v), 4) for v in matched[e]] for e in ESTIMATORS},
        "final_success": {e: [round(float(v), 4) for v in final[e]] for e in runs},
        "fallen_seeds": {e: [seed for seed, r in enumerate(runs[e]) if fallen(r)] for e in runs},
        "curve_updates": [u for u, _ in runs["rloo"][0]["curve"]],
        "curves": {e: [[round(float(s), 4) for _, s in r["curve"]] for r in runs[e]] for e in runs},
        "per_update": {e: {k: round(float(np.mean([s[k] for r in runs[e] for s in r["steps"]])) * batch, 1)
                           for k in COSTS} for e in runs},
        "trained_tokens_layout": TRAINED_TOKENS_LAYOUT,
        "wall_s_per_run": {e: [r["wall_s"] for r in runs[e]] for e in runs},
        "grad_norm_per_update": {e: round(float(np.mean([s["grad_norm"] for r in runs[e] for s in r["steps"]])), 4)
                                 for e in runs},
        "grad_tokens_per_batch": {"bpo": round(tok_b, 1), "rloo": round(tok_r, 1)},
        "grad_signal_to_noise": {"bpo": round(signal_to_noise(gram_b), 4), "rloo": qual["snr_rloo"]},
    }


# The real-engine tasks evaluate on their training games, in sampled episodes of their own (textworld_tasks).
EVALUATED = {False: "held-out success rate", True: "success rate (training games, own episodes)"}


def plot(task: DemoTask, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for estimator in runs:
        curves = np.array([[s for _, s in r["curve"]] for r in runs[estimator]])
        x = np.array([u for u, _ in runs[estimator][0]["curve"]])
        tokens = np.mean([s["generated_tokens"] for r in runs[estimator] for s in r["steps"]]) * task.batch
        mean = curves.mean(0)
        sem = curves.std(0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else 0 * mean
        for ax, xs in zip(axes, (x, x * tokens)):
            ax.plot(xs, mean, marker="o", label=f"{estimator.upper()} ({len(curves)} seeds)")
            ax.fill_between(xs, mean - 1.96 * sem, mean + 1.96 * sem, alpha=0.2)
    for ax, label in zip(axes, ("policy updates", "generated tokens")):
        ax.axhline(task.target, color="0.5", ls="--", lw=1, label=f"target {task.target}")
        ax.set(xlabel=label, ylabel=EVALUATED[list(task.eval_ids) == list(task.train_ids)],
               title=f"{task.name} task ({task.sandbox})")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(label: str, run: dict) -> None:
    print(f"{label}: success " + " ".join(f"{s:.2f}" for _, s in run["curve"]) + f"  ({run['wall_s']:.0f} s)",
          flush=True)


def _worker_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` processes sharing the machine's cores: independent runs of a tiny model scale better across
    processes than across one process's threads."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_threads, initargs=(threads,))


def control_settings(args: argparse.Namespace, task: DemoTask, updates: int) -> dict:
    """What the control's runs depend on: a saved control is reused (``--reuse-control``) only under these."""
    return {"seeds": args.seeds, "updates": updates, "lr": args.lr or task.lr, "adam_eps": args.adam_eps,
            "batch": task.batch, "eval_every": args.eval_every, "eval_episodes": args.eval_episodes,
            "warm_starts": args.warm_starts}


def reused_control(path: Path, settings: dict) -> dict:
    """The control's runs saved at ``path`` by a ``--control-only`` run, if it ran under ``settings``: per estimator,
    the first ``settings["seeds"]`` seeds' runs, or as many as were saved (the caller trains the rest, so a control
    grows seed by seed: seed s always trains from warm start s)."""
    if not path.is_file():
        raise SystemExit(f"--reuse-control: no saved control at {path}; run with --control-only and the same --out "
                         "first, or drop --reuse-control")
    saved = json.loads(path.read_text())
    differ = {k: (saved["settings"].get(k), v) for k, v in settings.items()
              if k != "seeds" and saved["settings"].get(k) != v}
    if differ:
        raise SystemExit(f"--reuse-control: {path} was trained with other settings (field: saved, now): {differ}; "
                         "use that run's settings or drop --reuse-control")
    return {e: saved[e][:settings["seeds"]] for e in ("rloo", CONTROL)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--updates", type=int, default=None, help="updates per run (default: the task's)")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-episodes", type=int, default=2, help="episodes per evaluation task per evaluation")
    parser.add_argument("--grad-draws", type=int, default=128, help="batches per estimator for the gradient variance")
    parser.add_argument("--grad-warmup", type=int, default=GRAD_WARMUP, help="BPO batches that teach its profile first")
    parser.add_argument("--max-leaves", type=int, default=MAX_LEAVES, help="bpo.learned.max_leaves of the BPO trees")
    parser.add_argument("--bpo-warmup-trees", type=int, default=BPO_WARMUP_TREES,
                        help="bpo.learned.warmup_trees: BPO's first trees of exploration shape (score-free)")
    parser.add_argument("--adam-eps", type=float, default=ADAM_EPS,
                        help="AdamW eps of every estimator (verl: actor.optim.override_optimizer_config.eps)")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate of every estimator (default: the task's, verl_bpo.demo.tasks)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs trained at once, each in its own process (default: 2 or the cores)")
    parser.add_argument("--batch", type=int, default=None, help="tasks per update (default: the task's)")
    parser.add_argument("--control-only", action="store_true",
                        help="calibration: train the control (RLOO, RLOO-2N) and print the verdict, no GRPO/BPO run")
    parser.add_argument("--match", choices=(*BASELINES, "own"), default="grpo",
                        help="whose generated tokens per task and update BPO's tree budget is (module docstring)")
    parser.add_argument("--tasks", nargs="+", default=default_tasks(), choices=list(BENCHMARK_TASKS),
                        help=f"default: every task but the step-bound reference {' '.join(REFERENCE_TASKS)} and the "
                             f"opt-in {' '.join(OPT_IN_TASKS)}")
    parser.add_argument("--warm-starts", choices=("per-seed", "one"), default="per-seed",
                        help="per-seed: seed s trains from warm start s, so the CI95 spans warm starts too; "
                             "one: every seed from warm start 0 (the records before 2026-12-06)")
    parser.add_argument("--reuse-control", action="store_true",
                        help="take the control's runs from a --control-only run into the same --out with the same "
                             "settings (its control_<task>.json) instead of training them again; seeds it lacks "
                             "are trained and saved with it")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    tree = tree_settings(args.max_leaves, args.bpo_warmup_trees)
    result: dict = {}
    pool = worker_pool(args.workers)
    for name in args.tasks:
        task = runnable(BENCHMARK_TASKS[name], out, args.batch)
        updates = args.updates or task.updates
        # Each seed's warm start, shared by its estimators so that the pairing holds. Warm start 0 first (it builds
        # the base model and tokenizer the others start from), the others on the pool.
        warm = {0: warm_start_model(out, task)}
        more = list(range(1, args.seeds)) if args.warm_starts == "per-seed" else []
        warm.update(zip(more, pool.map(warm_start_model, [out] * len(more), [task] * len(more), more)))
        model_dirs = [warm.get(seed, warm[0]) for seed in range(args.seeds)]
        runs: dict[str, list] = {e: [None] * args.seeds for e in ("rloo", CONTROL, "grpo", "bpo")}

        def train(jobs: list[tuple[str, int, dict]]) -> None:
            """Train ``(estimator, seed, keywords)`` runs on the pool; each lands in ``runs[estimator][seed]``."""
            futures = {pool.submit(train_one, model_dirs[s], task, "rloo" if e == CONTROL else e, s, args, updates,
                                   **kw): (e, s) for e, s, kw in jobs}
            for future in as_completed(futures):
                estimator, seed = futures[future]
                runs[estimator][seed] = future.result()
                report(f"{name} seed {seed} {estimator:7s}", runs[estimator][seed])

        # The control alone decides whether the task qualifies, before any BPO run: RLOO's warm-start gradient
        # noise, then RLOO and RLOO with 2N rollouts on every seed.
        rloo_grads = pool.submit(gradient_draws, model_dirs[0], task, "rloo", args.grad_draws, 0, tree)
        saved = out / f"control_{name}.json"
        settings = control_settings(args, task, updates)
        have = 0
        if args.reuse_control:
            reused = reused_control(saved, settings)
            for e, saved_runs in reused.items():
                runs[e][:len(saved_runs)] = saved_runs
            have = len(reused["rloo"])
        if have < args.seeds:
            train([(e, seed, {"rollout_n": 2 * ROLLOUT_N} if e == CONTROL else {})
                   for seed in range(have, args.seeds) for e in ("rloo", CONTROL)])
            saved.write_text(json.dumps({"settings": settings, **{e: runs[e] for e in ("rloo", CONTROL)}}))
        grads = {"rloo": rloo_grads.result()}
        censored = updates + args.eval_every
        qual = qualification([updates_to_target(r, task.target, censored) for r in runs[CONTROL]],
                             [updates_to_target(r, task.target, censored) for r in runs["rloo"]],
                             grads["rloo"][0])
        lo, hi = qual["ci95"]
        print(f"{name}: qualified={str(qual['qualified']).lower()} (RLOO-2N/RLOO updates to target "
              f"{qual['updates_to_target_rloo_2n_over_rloo']:.3f}, CI95 [{lo}, {hi}]; RLOO SNR {qual['snr_rloo']:.3g}, "
              f"CI95 {qual['snr_rloo_ci95']})"
              f" — rule: {QUALIFY_RULE}", flush=True)
        if args.control_only:
            result.update({f"{name}_{k}": v for k, v in qual.items()})
            result[f"{name}_wall_s_per_run"] = {e: [r["wall_s"] for r in runs[e]] for e in ("rloo", CONTROL)}
            continue
        bpo_grads = pool.submit(gradient_draws, model_dirs[0], task, "bpo", args.grad_draws, args.grad_warmup, tree)
        if args.match == "grpo":  # the paired baseline trains first: BPO's tree budgets are its tokens
            train([("grpo", seed, {}) for seed in range(args.seeds)])

        def budgets(seed: int) -> list | None:
            return None if args.match == "own" else [s["tree_tokens"] for s in runs[args.match][seed]["steps"]]

        train([("bpo", seed, {"budgets": budgets(seed)}) for seed in range(args.seeds)])
        if args.match != "grpo":
            train([("grpo", seed, {}) for seed in range(args.seeds)])
        grads["bpo"] = bpo_grads.result()
        print(f"{name}: tr Cov x tokens at the warm start: "
              + ", ".join(f"{e} {trace_cov(g) * t:.4g} ({t:.0f} tokens)" for e, (g, t, _) in grads.items()), flush=True)
        summary = summarize(name, runs, grads, target=task.target, updates=updates, eval_every=args.eval_every,
                            batch=task.batch)
        result.update({f"{name}_{k}": v for k, v in summary.items()})
        plot(task, runs, out / f"learning_{name}.png")
        (out / f"runs_{name}.json").write_text(json.dumps(runs))
    pool.shutdown()
    result.update({"tasks": args.tasks, "workers": args.workers,
                   "reference_tasks": [t for t in args.tasks if t in REFERENCE_TASKS],
                   "qualified": {t: result[f"{t}_qualified"] for t in args.tasks}, "control_only": args.control_only,
                   "seeds": args.seeds, "updates": {t: args.updates or BENCHMARK_TASKS[t].updates for t in args.tasks},
                   "lr": {t: args.lr or BENCHMARK_TASKS[t].lr for t in args.tasks},
                   "rollout_n": ROLLOUT_N, "batch": {t: args.batch or BENCHMARK_TASKS[t].batch for t in args.tasks},
                   "max_leaves": args.max_leaves, "bpo_warmup_trees": args.bpo_warmup_trees,
                   "adam_eps": args.adam_eps, "match": args.match, "warm_starts": args.warm_starts,
                   "control": list(args.tasks),
                   "qualify_rule": QUALIFY_RULE, "wall_s": round(time.monotonic() - start)})
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out}/learning_*.png and learning.json")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
