"""The paper's learning claims, measured: BPO vs GRPO vs RLOO trained at matched generated tokens per update.

Two embedded tasks (``verl_bpo.demo.tasks``): ``late`` — the signpost corridor, where routine moves come first and
the one decisive choice last — and ``early`` — the same corridor with the choice first, so the first move decides
and the walk after it only reveals the outcome. For each task and seed, every estimator trains from the same warm
start on the same task order with :class:`verl_bpo.local.trainer.LocalRL` (the real tree sampler, verl's estimator
registry and policy loss with the arguments verl's actor passes; an in-process policy and optimizer instead of vLLM
and FSDP, so that several seeds fit on a CPU box). Matched compute: GRPO and RLOO take N = 8 independent rollouts
per task; BPO grows one tree per task with ``bpo.allocation=learned`` and ``bpo.budget=tokens``, up to
``--max-leaves`` leaves. Its tree's token budget is, by default (``--match grpo``), exactly the tokens GRPO's group
generated on the same task at the same update of the same seed (GRPO trains first), so BPO and GRPO are matched in
generated tokens per update throughout training, not only at the warm start; ``--match rloo`` pairs with RLOO
instead, and ``--match own`` gives each tree what N flat rollouts of BPO's own policy would generate, learned from
its earlier trees (the tokens then follow each estimator's policy and are matched at the warm start only). Every
update has the same tasks, learning rate (the task's, or ``--lr``) and one AdamW step (``eps`` 1e-5,
``--adam-eps``: with torch's 1e-8 single updates break the warm start's format for every estimator,
``benchmarks/first_updates.py``). Generated tokens, environment steps and trainer rows per update are reported for
each estimator.

Measured, per task, seed and estimator:

* **success curve** — every ``--eval-every`` updates, the success rate of ``--eval-episodes`` independent sampled
  episodes on each held-out evaluation task (task ids never trained on; the same tasks and sandbox seeds for every
  estimator);
* **updates to target** — the first evaluated update whose success reaches the task's target (a seed that never
  does counts as ``--updates`` + ``--eval-every``, stated as censored);
* **tokens to target** — the generated tokens spent until then (a censored seed at its mean rate per update): the
  comparison at matched generated tokens with the estimator BPO is not paired with (and under ``--match own``);
* **final success** — the mean of the last two evaluations;
* **success at matched tokens** — per seed, each run's success once it has generated as many tokens as the run
  that generated least over its ``--updates`` (interpolated between evaluations): the end of training at matched
  generated tokens;
* **gradient variance at matched tokens** — at the warm-start policy, ``--grad-draws`` independent batches per
  estimator (BPO after ``--grad-warmup`` batches that teach its profile): tr Cov(ĝ) × generated tokens per batch,
  BPO over RLOO (both unbiased and on one scale);
* **what halving the variance can buy** (the tasks in ``--control``, default ``late``) — RLOO trained with 2N
  rollouts per task: exactly half RLOO's gradient variance per update, at twice its tokens. Its updates to target
  over RLOO's bound what any estimator with half RLOO's variance per update could save in updates on that task at
  that learning rate: near 1, progress per update is limited by the optimizer's step, not by gradient noise.

95% confidence intervals: paired bootstrap over seeds (learning), bootstrap over draws (variance).

    python benchmarks/learning.py [--seeds 4] [--updates 16] [--match grpo] [--out runs/learning]

Last line: one JSON object with, per task prefix ``late_`` and ``early_``: ``updates_to_target_bpo_over_grpo``,
``tokens_to_target_bpo_over_grpo``, ``final_success_bpo_minus_grpo``, ``final_success_bpo_minus_rloo``,
``success_at_matched_tokens_bpo_minus_grpo`` (and ``_rloo``), ``grad_var_bpo_over_rloo``, their ``ci95``, and
tokens, env steps, trainer rows and pre-clip gradient norm per update per estimator; with the control,
``updates_to_target_rloo_2n_over_rloo`` and ``final_success_rloo_2n_minus_rloo``. Targets (the paper's, on the
late task): updates <= 0.62, success >= +0.036, gradient variance <= 0.5; on the early task: success vs RLOO
>= -0.02 (a tie).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from verl_bpo.demo.tasks import TASKS, DemoTask, task_model
from verl_bpo.local.trainer import LocalRL, LocalRLConfig

ESTIMATORS = ("bpo", "grpo", "rloo")
BASELINES = ("grpo", "rloo")
CONTROL = "rloo_2n"  # RLOO with 2N rollouts per task: half RLOO's variance per update, twice its tokens
N_LEAVES, BATCH, RESPONSE_LENGTH, MAX_TOKENS_PER_TURN = 8, 4, 384, 6
ADAM_EPS = 1e-5  # torch's 1e-8 lets single updates break the warm start (benchmarks/first_updates.py)
MAX_LEAVES, BPO_WARMUP_TREES = 32, 8  # the defaults of --max-leaves and --bpo-warmup-trees


def bpo_block(task: DemoTask, estimator: str, tree: dict) -> dict:
    """The ``bpo:`` block; ``tree`` holds the BPO tree's own settings from the command line."""
    block = {"max_turns": task.max_turns, "max_tokens_per_turn": MAX_TOKENS_PER_TURN}
    if estimator == "bpo":
        block.update(allocation="learned", budget="tokens", explore_share=0.1, **tree)
    return block


def tree_settings(max_leaves: int = MAX_LEAVES, warmup_trees: int = BPO_WARMUP_TREES) -> dict:
    return {"max_leaves": max_leaves, "warmup_trees": warmup_trees}


def task_order(task: DemoTask, seed: int) -> list[dict[str, int]]:
    """The training tasks in the order a seed trains on them, the same for every estimator."""
    return random.Random(seed).sample(task.tasks(task.train_ids), len(task.train_ids))


def update_batch(order: list[dict[str, int]], update: int) -> list[dict[str, int]]:
    """The tasks of one update."""
    return [order[(update * BATCH + j) % len(order)] for j in range(BATCH)]


def trainer(model_dir: Path, task: DemoTask, estimator: str, seed: int, tree: dict,
            adam_eps: float = ADAM_EPS, lr: float | None = None, n_leaves: int = N_LEAVES) -> LocalRL:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LocalRLConfig(estimator=estimator, n_leaves=n_leaves, batch_size=BATCH, lr=lr or task.lr,
                           adam_eps=adam_eps, response_length=RESPONSE_LENGTH, bpo=bpo_block(task, estimator, tree))
    return LocalRL(model, AutoTokenizer.from_pretrained(model_dir), task.sandbox, task.sandbox_config, config,
                   seed=seed)


def train_one(model_dir: Path, task: DemoTask, estimator: str, seed: int, args: argparse.Namespace,
              budgets: list[list[float]] | None = None, n_leaves: int = N_LEAVES) -> dict:
    """One training run; ``budgets[u]``: the token budget of each task's tree at update ``u`` (BPO at matched
    tokens), ``None``: learned from the run's own earlier trees."""
    rl = trainer(model_dir, task, estimator, seed, tree_settings(args.max_leaves, args.bpo_warmup_trees),
                 args.adam_eps, args.lr, n_leaves)
    order = task_order(task, seed)
    evals = task.tasks(task.eval_ids)
    curve, steps = [(0, rl.evaluate(evals, args.eval_episodes))], []
    for u in range(args.updates):
        steps.append(rl.step(update_batch(order, u), None if budgets is None else budgets[u]).__dict__)
        if (u + 1) % args.eval_every == 0:
            curve.append((u + 1, rl.evaluate(evals, args.eval_episodes)))
    return {"curve": curve, "steps": steps}


def gradient_draws(model_dir: Path, task: DemoTask, estimator: str, draws: int, warmup: int,
                   tree: dict) -> tuple[np.ndarray, float]:
    """The Gram matrix of ``draws`` batch gradients at the warm-start policy, and the mean tokens per batch."""
    rl = trainer(model_dir, task, estimator, 0, tree)
    tasks = task.tasks(task.train_ids)[:BATCH]
    rows, tokens = [], []
    for d in range(warmup + draws):
        rl.updates = d  # a fresh tree seed per draw; the weights never change
        results = rl.rollout(tasks)
        if d < warmup:  # BPO's profile learns from these trees; they are not measured
            continue
        rl.gradient(results)
        rows.append(rl.flat_gradient())
        tokens.append(sum(r.metrics["bpo/generated_tokens"] for r in results))
    g = np.stack(rows).astype(np.float64)
    return g @ g.T, float(np.mean(tokens))


def trace_cov(gram: np.ndarray, idx: np.ndarray | None = None) -> float:
    """tr Cov of the draws ``idx`` from their Gram matrix: Σ‖ĝ_i − ḡ‖² = Σ‖ĝ_i‖² − n‖ḡ‖² (a bootstrap resample
    costs O(draws²), not O(draws × parameters))."""
    idx = np.arange(len(gram)) if idx is None else idx
    sub = gram[np.ix_(idx, idx)]
    n = len(idx)
    return (float(np.trace(sub)) - float(sub.sum()) / n) / (n - 1)


def signal_to_noise(gram: np.ndarray) -> float:
    """‖E ĝ‖² / tr Cov(ĝ) of one batch gradient, from the draws' Gram matrix (‖E ĝ‖² estimated without bias by the
    mean inner product of distinct draws): below 1, a batch's noise outweighs its signal."""
    n = len(gram)
    mean_sq = (float(gram.sum()) - float(np.trace(gram))) / (n * (n - 1))
    return mean_sq / trace_cov(gram)


def bootstrap(stat, n: int, reps: int = 2000, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    values = [stat(rng.integers(0, n, n)) for _ in range(reps)]
    return [round(float(np.percentile(values, 2.5)), 4), round(float(np.percentile(values, 97.5)), 4)]


def tokens_per_update(run: dict) -> list[float]:
    """Generated tokens of each update of a run (its steps record the mean per tree)."""
    return [s["generated_tokens"] * BATCH for s in run["steps"]]


def tokens_until(run: dict, update: int) -> float:
    """Generated tokens of a run's first ``update`` updates; past its last update (censored), its mean rate."""
    per_update = tokens_per_update(run)
    if update <= len(per_update):
        return float(sum(per_update[:update]))
    return float(np.mean(per_update)) * update


def success_at_tokens(run: dict, tokens: float) -> float:
    """A run's held-out success once it has generated ``tokens``, interpolated linearly between evaluations."""
    spent = np.concatenate([[0.0], np.cumsum(tokens_per_update(run))])
    return float(np.interp(tokens, [spent[u] for u, _ in run["curve"]], [s for _, s in run["curve"]]))


def summarize(task: DemoTask, runs: dict, grads: dict, args: argparse.Namespace) -> dict:
    censored = args.updates + args.eval_every
    reach = {e: np.array([next((u for u, s in r["curve"] if s >= task.target), censored) for r in runs[e]])
             for e in runs}
    # BPO's budgets match its paired baseline's tokens per update, not the other's (nor anyone's under --match own),
    # and a tree may leave some of its budget unspent, so the generated tokens spent to reach the target are
    # reported next to the updates.
    reach_tokens = {e: np.array([tokens_until(r, u) for r, u in zip(runs[e], reach[e])]) for e in ESTIMATORS}
    # Success at matched generated tokens: per seed, where the run that generated least stopped.
    least = [min(tokens_until(runs[e][s], args.updates) for e in ESTIMATORS) for s in range(args.seeds)]
    matched = {e: np.array([success_at_tokens(r, t) for r, t in zip(runs[e], least)]) for e in ESTIMATORS}
    final = {e: np.array([np.mean([s for _, s in r["curve"][-2:]]) for r in runs[e]]) for e in runs}
    n = args.seeds
    (gram_b, tok_b), (gram_r, tok_r) = grads["bpo"], grads["rloo"]

    def var_ratio(i: np.ndarray) -> float:
        return trace_cov(gram_b, i) * tok_b / (trace_cov(gram_r, i) * tok_r)

    def over(stat: dict, a: str, b: str):
        return lambda i: stat[a][i].mean() / stat[b][i].mean()

    def minus(stat: dict, a: str, b: str):
        return lambda i: stat[a][i].mean() - stat[b][i].mean()

    # Statistics of the seeds ``i``: one formula gives each key its point estimate (all seeds) and paired CI.
    paired = {
        "updates_to_target_bpo_over_grpo": over(reach, "bpo", "grpo"),
        "tokens_to_target_bpo_over_grpo": over(reach_tokens, "bpo", "grpo"),
        "final_success_bpo_minus_grpo": minus(final, "bpo", "grpo"),
        "final_success_bpo_minus_rloo": minus(final, "bpo", "rloo"),
        "success_at_matched_tokens_bpo_minus_grpo": minus(matched, "bpo", "grpo"),
        "success_at_matched_tokens_bpo_minus_rloo": minus(matched, "bpo", "rloo"),
    }
    if CONTROL in runs:
        paired["updates_to_target_rloo_2n_over_rloo"] = over(reach, CONTROL, "rloo")
        paired["final_success_rloo_2n_minus_rloo"] = minus(final, CONTROL, "rloo")
    out = {
        **{k: round(float(stat(np.arange(n))), 4) for k, stat in paired.items()},
        "grad_var_bpo_over_rloo": round(var_ratio(np.arange(args.grad_draws)), 4),
        "ci95": {**{k: bootstrap(stat, n) for k, stat in paired.items()},
                 "grad_var_bpo_over_rloo": bootstrap(var_ratio, args.grad_draws)},
        "target_success": task.target,
        "updates_to_target": {e: reach[e].tolist() for e in runs},
        "censored_at": censored,
        "tokens_to_target": {e: [round(float(v)) for v in reach_tokens[e]] for e in ESTIMATORS},
        "matched_tokens": [round(t) for t in least],
        "success_at_matched_tokens": {e: [round(float(v), 4) for v in matched[e]] for e in ESTIMATORS},
        "final_success": {e: [round(float(v), 4) for v in final[e]] for e in runs},
        "per_update": {e: {k: round(float(np.mean([s[k] for r in runs[e] for s in r["steps"]])) * BATCH, 1)
                           for k in ("generated_tokens", "env_steps", "trainer_rows")} for e in runs},
        "grad_norm_per_update": {e: round(float(np.mean([s["grad_norm"] for r in runs[e] for s in r["steps"]])), 4)
                                 for e in runs},
        "grad_tokens_per_batch": {"bpo": round(tok_b, 1), "rloo": round(tok_r, 1)},
        "grad_signal_to_noise": {"bpo": round(signal_to_noise(gram_b), 4), "rloo": round(signal_to_noise(gram_r), 4)},
    }
    return out


def plot(task: DemoTask, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for estimator in runs:
        curves = np.array([[s for _, s in r["curve"]] for r in runs[estimator]])
        x = np.array([u for u, _ in runs[estimator][0]["curve"]])
        tokens = np.mean([s["generated_tokens"] for r in runs[estimator] for s in r["steps"]]) * BATCH
        mean = curves.mean(0)
        sem = curves.std(0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else 0 * mean
        for ax, xs in zip(axes, (x, x * tokens)):
            ax.plot(xs, mean, marker="o", label=f"{estimator.upper()} ({len(curves)} seeds)")
            ax.fill_between(xs, mean - 1.96 * sem, mean + 1.96 * sem, alpha=0.2)
    for ax, label in zip(axes, ("policy updates", "generated tokens")):
        ax.axhline(task.target, color="0.5", ls="--", lw=1, label=f"target {task.target}")
        ax.set(xlabel=label, ylabel="held-out success rate", title=f"{task.name}-decision task ({task.sandbox})")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(label: str, run: dict, t0: float) -> None:
    print(f"{label}: success " + " ".join(f"{s:.2f}" for _, s in run["curve"]) + f"  ({time.monotonic() - t0:.0f} s)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-episodes", type=int, default=2, help="episodes per held-out task per evaluation")
    parser.add_argument("--grad-draws", type=int, default=128, help="batches per estimator for the gradient variance")
    parser.add_argument("--grad-warmup", type=int, default=4, help="BPO batches that teach its profile first")
    parser.add_argument("--max-leaves", type=int, default=MAX_LEAVES, help="bpo.max_leaves of the BPO trees")
    parser.add_argument("--bpo-warmup-trees", type=int, default=BPO_WARMUP_TREES,
                        help="bpo.warmup_trees: BPO's first trees of exploration shape (score-free)")
    parser.add_argument("--adam-eps", type=float, default=ADAM_EPS,
                        help="AdamW eps of every estimator (verl: actor.optim.override_optimizer_config.eps)")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate of every estimator (default: the task's, verl_bpo.demo.tasks)")
    parser.add_argument("--match", choices=(*BASELINES, "own"), default="grpo",
                        help="whose generated tokens per task and update BPO's tree budget is (module docstring)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--control", nargs="*", default=["late"], choices=list(TASKS),
                        help="tasks that also train RLOO with 2N rollouts per task (what halving the variance buys)")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    result: dict = {}
    for name in args.tasks:
        task = TASKS[name]
        model_dir = task_model(out, task)
        grads = {e: gradient_draws(model_dir, task, e, args.grad_draws, args.grad_warmup if e == "bpo" else 0,
                                   tree_settings(args.max_leaves, args.bpo_warmup_trees)) for e in ("bpo", "rloo")}
        print(f"{name}: tr Cov x tokens at the warm start: "
              + ", ".join(f"{e} {trace_cov(g) * t:.4g} ({t:.0f} tokens)" for e, (g, t) in grads.items()), flush=True)
        runs: dict[str, list] = {e: [] for e in ESTIMATORS}
        for seed in range(args.seeds):
            # The paired baseline trains first: BPO's tree budgets are its tokens per task and update.
            for estimator in sorted(ESTIMATORS, key=lambda e: (e == "bpo", e != args.match)):
                t0 = time.monotonic()
                budgets = None
                if estimator == "bpo" and args.match != "own":
                    budgets = [s["tree_tokens"] for s in runs[args.match][seed]["steps"]]
                runs[estimator].append(train_one(model_dir, task, estimator, seed, args, budgets))
                report(f"{name} seed {seed} {estimator:4s}", runs[estimator][-1], t0)
            if name in args.control:
                t0 = time.monotonic()
                runs.setdefault(CONTROL, []).append(train_one(model_dir, task, "rloo", seed, args,
                                                              n_leaves=2 * N_LEAVES))
                report(f"{name} seed {seed} {CONTROL}", runs[CONTROL][-1], t0)
        summary = summarize(task, runs, grads, args)
        result.update({f"{name}_{k}": v for k, v in summary.items()})
        plot(task, runs, out / f"learning_{name}.png")
        (out / f"runs_{name}.json").write_text(json.dumps(runs))
    result.update({"seeds": args.seeds, "updates": args.updates,
                   "lr": {t: args.lr or TASKS[t].lr for t in args.tasks},
                   "n_leaves": N_LEAVES, "batch": BATCH, "max_leaves": args.max_leaves,
                   "bpo_warmup_trees": args.bpo_warmup_trees, "adam_eps": args.adam_eps, "match": args.match,
                   "control": [t for t in args.tasks if t in args.control],
                   "wall_s": round(time.monotonic() - start)})
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out}/learning_*.png and learning.json")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
