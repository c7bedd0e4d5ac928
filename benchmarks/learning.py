"""The paper's learning claims, measured on the CPU demo task: BPO vs GRPO at matched compute over several seeds.

Task, model and settings are the demo's (``verl_bpo.demo``): the smoke corridor, the tiny Qwen2 warm-started on
random-policy chats, N = 8 leaves per task, 4 tasks per update, the same learning rate. Each seed trains both
estimators from the same warm start on the same task order, with :class:`verl_bpo.local_trainer.LocalRL` (the real
tree sampler, verl's estimator registry and loss; an in-process policy and optimizer instead of vLLM and FSDP, so
that several seeds fit in minutes). Matched compute = the same leaves per task and the same updates; BPO's trees
also spend fewer environment steps and generated tokens per leaf, reported alongside.

Measured, per seed and estimator:

* **success curve** — every ``--eval-every`` updates, the success rate of 2 sampled episodes on each of 64 fixed
  evaluation tasks;
* **updates to target** — the first evaluated update whose success reaches ``--target`` (a seed that never does
  counts as ``--updates`` + ``--eval-every``, stated as censored);
* **final success** — the mean of the last two evaluations;
* **gradient variance** — at the warm-start policy, ``--grad-draws`` independent batches (same tasks) per estimator:
  tr Cov(ĝ) / ‖E ĝ‖² (scale-free, since GRPO's std scaling changes the gradient's scale; as in
  ``benchmarks/variance.py``); the raw tr Cov ratio is printed too, and both against RLOO (unbiased, and on BPO's
  scale, so there the raw ratio compares like with like).

95% confidence intervals: paired bootstrap over seeds (learning), bootstrap over draws (variance).

    python benchmarks/learning.py [--seeds 4] [--updates 24] [--target 0.5] [--out runs/learning]

Last line: {"updates_to_target_bpo_over_grpo": .., "final_success_bpo_minus_grpo": ..,
"grad_norm_var_bpo_over_grpo": .., ...}. The paper's targets: updates <= 0.62, success difference >= 0.036,
gradient variance <= 0.5.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from verl_bpo.demo.cpu_demo import SMOKE, TASKS, DemoSettings, demo_model
from verl_bpo.local.trainer import LocalRL, LocalRLConfig

ESTIMATORS = ("bpo", "grpo")
# RLOO is the unbiased flat baseline on BPO's own scale: its gradient variance is compared too (not trained).
GRADIENT_ESTIMATORS = ("bpo", "grpo", "rloo")
EVAL_TASKS = [{"task_id": i} for i in range(64)]


def make_config(estimator: str) -> LocalRLConfig:
    s = DemoSettings()
    return LocalRLConfig(estimator=estimator, n_leaves=s.n_leaves, batch_size=s.batch_size, lr=s.lr,
                         response_length=s.response_length, bpo=s.bpo_block())


def load(model_dir: Path, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(model_dir)


def train_one(model_dir: Path, estimator: str, seed: int, updates: int, eval_every: int) -> dict:
    model, tokenizer = load(model_dir, seed)
    trainer = LocalRL(model, tokenizer, "smoke", SMOKE, make_config(estimator), seed=seed)
    order = random.Random(seed).sample(TASKS, len(TASKS))  # the same task order for both estimators of a seed
    batch = trainer.config.batch_size
    curve, steps = [(0, trainer.evaluate(EVAL_TASKS))], []
    for u in range(updates):
        tasks = [order[(u * batch + j) % len(order)] for j in range(batch)]
        steps.append(trainer.step(tasks).__dict__)
        if (u + 1) % eval_every == 0:
            curve.append((u + 1, trainer.evaluate(EVAL_TASKS)))
    return {"curve": curve, "steps": steps}


def updates_to(curve: list[tuple[int, float]], target: float, censored_at: int) -> int:
    return next((u for u, s in curve if s >= target), censored_at)


def gradient_variance(model_dir: Path, draws: int, seed: int = 0) -> dict:
    """Per estimator, the Gram matrix of its gradients at the warm-start policy over ``draws`` batches."""
    tasks = TASKS[: DemoSettings.batch_size]
    grads = {}
    for estimator in GRADIENT_ESTIMATORS:
        model, tokenizer = load(model_dir, seed)
        trainer = LocalRL(model, tokenizer, "smoke", SMOKE, make_config(estimator), seed=seed)
        rows = []
        for d in range(draws):
            trainer.updates = d  # a fresh tree seed per draw; the weights never change
            trainer.gradient(trainer.rollout(tasks))
            rows.append(trainer.flat_gradient())
        g = np.stack(rows).astype(np.float64)
        grads[estimator] = g @ g.T  # only inner products are needed
    return grads


def variance_stats(gram: np.ndarray, idx: np.ndarray | None = None) -> tuple[float, float]:
    """(tr Cov, unbiased ‖E ĝ‖²) of the draws ``idx`` (all by default), from the draws' Gram matrix ĝ_i·ĝ_j:
    Σ‖ĝ_i − ḡ‖² = Σ‖ĝ_i‖² − n‖ḡ‖², so a bootstrap resample costs O(draws²), not O(draws × parameters)."""
    idx = np.arange(len(gram)) if idx is None else idx
    sub = gram[np.ix_(idx, idx)]
    n = len(idx)
    mean_sq = float(sub.sum()) / n**2
    tr_cov = (float(np.trace(sub)) - n * mean_sq) / (n - 1)
    return tr_cov, mean_sq - tr_cov / n


def bootstrap(stat, n: int, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    values = [stat(rng.integers(0, n, n)) for _ in range(reps)]
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def plot(runs: dict, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for estimator in ESTIMATORS:
        curves = np.array([[s for _, s in r["curve"]] for r in runs[estimator]])
        x = [u for u, _ in runs[estimator][0]["curve"]]
        mean, sem = curves.mean(0), curves.std(0, ddof=1) / np.sqrt(len(curves)) if len(curves) > 1 else 0 * curves[0]
        ax.plot(x, mean, marker="o", label=f"{estimator.upper()} ({len(curves)} seeds)")
        ax.fill_between(x, mean - 1.96 * sem, mean + 1.96 * sem, alpha=0.2)
    ax.axhline(target, color="0.5", ls="--", lw=1, label=f"target {target}")
    ax.set(xlabel="policy updates", ylabel="evaluation success rate", title="Smoke corridor, tiny model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--updates", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.5, help="evaluation success that counts as reached")
    parser.add_argument("--grad-draws", type=int, default=96,
                        help="independent batches per estimator for the gradient variance (heavy-tailed: use many)")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    model_dir = demo_model(out)

    grads = gradient_variance(model_dir, args.grad_draws)
    var = {e: variance_stats(g) for e, g in grads.items()}
    rel = {e: v[0] / max(v[1], 1e-30) for e, v in var.items()}
    print(f"gradient at the warm start ({args.grad_draws} draws): "
          + ", ".join(f"{e} tr Cov {v[0]:.3g} |E g|^2 {v[1]:.3g}" for e, v in var.items()), flush=True)

    def rel_ratio(idx: np.ndarray, baseline: str = "grpo") -> float:
        b, g = (variance_stats(grads[e], idx) for e in ("bpo", baseline))
        return (b[0] / max(b[1], 1e-30)) / (g[0] / max(g[1], 1e-30))

    runs: dict[str, list[dict]] = {e: [] for e in ESTIMATORS}
    for seed in range(args.seeds):
        for estimator in ESTIMATORS:
            t0 = time.monotonic()
            run = train_one(model_dir, estimator, seed, args.updates, args.eval_every)
            runs[estimator].append(run)
            print(f"seed {seed} {estimator:4s}: success " + " ".join(f"{s:.2f}" for _, s in run["curve"])
                  + f"  ({time.monotonic() - t0:.0f} s)", flush=True)

    censored = args.updates + args.eval_every
    reach = {e: np.array([updates_to(r["curve"], args.target, censored) for r in runs[e]]) for e in ESTIMATORS}
    final = {e: np.array([np.mean([s for _, s in r["curve"][-2:]]) for r in runs[e]]) for e in ESTIMATORS}
    cost = {e: {k: float(np.mean([s[k] for r in runs[e] for s in r["steps"]]))
                for k in ("env_steps_per_leaf", "generated_tokens_per_leaf", "zero_advantage_share")}
            for e in ESTIMATORS}
    n = args.seeds
    result = {
        "updates_to_target_bpo_over_grpo": float(reach["bpo"].mean() / reach["grpo"].mean()),
        "final_success_bpo_minus_grpo": float(final["bpo"].mean() - final["grpo"].mean()),
        "grad_norm_var_bpo_over_grpo": float(rel["bpo"] / rel["grpo"]),
        "ci95": {
            "updates_to_target_bpo_over_grpo": bootstrap(
                lambda i: reach["bpo"][i].mean() / reach["grpo"][i].mean(), n),
            "final_success_bpo_minus_grpo": bootstrap(lambda i: final["bpo"][i].mean() - final["grpo"][i].mean(), n),
            "grad_norm_var_bpo_over_grpo": bootstrap(rel_ratio, args.grad_draws),
        },
        "raw_grad_var_bpo_over_grpo": var["bpo"][0] / var["grpo"][0],
        "grad_var_bpo_over_rloo": var["bpo"][0] / var["rloo"][0],
        "grad_rel_var_bpo_over_rloo": rel["bpo"] / rel["rloo"],
        "grad_rel_var_bpo_over_rloo_ci95": bootstrap(lambda i: rel_ratio(i, "rloo"), args.grad_draws),
        "target_success": args.target,
        "updates_to_target": {e: reach[e].tolist() for e in ESTIMATORS},
        "censored_at": censored,
        "final_success": {e: final[e].tolist() for e in ESTIMATORS},
        "cost_per_leaf": cost,
        "seeds": n,
        "updates": args.updates,
        "wall_s": round(time.monotonic() - start),
    }
    plot(runs, out / "learning.png", args.target)
    (out / "runs.json").write_text(json.dumps(runs))
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'learning.png'} and {out / 'learning.json'}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
