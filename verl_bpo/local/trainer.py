"""An in-process policy-gradient loop over the tree sampler, for experiments that need many seeds on one machine.

``benchmarks/learning.py`` compares BPO and GRPO over several seeds; starting Ray, vLLM and FSDP once per seed and
estimator would take most of its time on a small CPU box. This loop keeps every part that decides the comparison
and replaces only the serving and sharding machinery:

* the rollout is the real :class:`~verl_bpo.rollout.sampler.TreeSampler` (tree mode for ``bpo``, flat mode for
  the baselines, from the same ``bpo`` settings) on a real sandbox, with one
  :class:`~verl_bpo.core.fork_policy.ForkPolicy` kept across updates, as an agent-loop worker keeps it;
* advantages come from verl's estimator registry (``core_algos.get_adv_estimator_fn``): this plugin's ``bpo``, and
  verl's own ``grpo``/``rloo``, called the way verl's trainer calls them, with the BPO trainer's rows per tree;
* the loss is verl's actor loss, ``ppo_loss`` on verl's actor config, called as verl's actor calls it
  (:func:`~verl_bpo.integration.actor_loss.actor_loss`: the batch's rows as ``global_batch_size``, the response
  length as ``loss_scale_factor``), with verl's default gradient clipping (1.0); ``grad_norm`` is the pre-clip
  norm, as verl's actor logs it;
* stand-ins: the policy is served in-process by :class:`~verl_bpo.local.hf_client.BatchedHFClient` instead of vLLM, and
  updated with one AdamW step per batch on one process instead of FSDP. That is what verl does with one PPO epoch
  and one mini-batch per step (the ratio is 1 on-policy, so clipping never binds).

Rollouts are reproducible: every tree's seed is a function of the run's seed, the update, the tree's place in the
batch and whether it trains or evaluates, and its turns are sampled with seeds derived from it (the sampler's
``seeded_turns``, under which a forking tree also grows in waves), and the fork policy learns from a batch's trees in
task order, so a rollout, flat group or tree, is the same whenever its sandboxes answer (barring a step that times out:
its retry follows the latency). Runs of different estimators on one seed share their draws where their policies agree
(common random numbers: at the warm start, the same rollouts).

The CPU demo (``python -m verl_bpo.demo``) runs the same comparison through verl's real trainer, on one seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sandbox_adapters.registry import make_sandbox
from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.core.packing import LeafTokens, pack_tree
from verl_bpo.integration.actor_loss import actor_loss
from verl_bpo.integration.batch_layout import rows_per_tree
from verl_bpo.local.hf_client import BatchedHFClient, TemplateCodec
from verl_bpo.rollout.sampler import TreeSampler
from verl_bpo.rollout.tree_state import Leaf, TreeResult, derive_seed

__all__ = ["LocalRLConfig", "LocalRL", "StepStats", "trained_tokens"]


@dataclasses.dataclass
class LocalRLConfig:
    """One training run's settings (matched between estimators in a comparison).

    Attributes:
        estimator: verl advantage estimator name: ``bpo`` (trees) or a flat baseline (``grpo``, ``rloo``).
        rollout_n: leaves (rollouts) per task: verl's ``rollout.n``. Default 8.
        batch_size: tasks per policy update: verl's ``data.train_batch_size``. Default 4.
        lr: AdamW learning rate. Default 1e-3.
        adam_eps: AdamW's ``eps`` (verl: ``actor.optim.override_optimizer_config.eps``). Default 1e-8, torch's.
            Adam moves every weight by about ``lr`` on its first steps however small its gradient; an ``eps``
            near the per-weight gradient size damps that for weights the batch barely touches.
        grad_clip: gradient-norm clip, verl's ``actor.grad_clip``. Default 1.0.
        response_length: verl's ``rollout.response_length``; also the ``seq-mean-token-sum-norm`` scale. Default 320.
        loss_agg_mode: verl's ``actor.loss_agg_mode``. Default ``seq-mean-token-sum-norm`` (the plugin's default).
        gamma: ``algorithm.gamma``. Default 1.0.
        temperature: sampling temperature. Default 1.0.
        bpo: the ``bpo:`` block (``allocation``, ``fixed``, ``learned``, ``max_turns``, ...), as in verl's config.
    """

    estimator: str = "bpo"
    rollout_n: int = 8
    batch_size: int = 4
    lr: float = 1e-3
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    response_length: int = 320
    loss_agg_mode: str = "seq-mean-token-sum-norm"
    gamma: float = 1.0
    temperature: float = 1.0
    bpo: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StepStats:
    """What one update saw: rollout outcomes, cost and the gradient."""

    success_rate: float
    leaf_return: float
    grad_norm: float
    env_steps: float
    generated_tokens: float
    trainer_rows: float
    zero_advantage_share: float
    tree_tokens: list[float] = dataclasses.field(default_factory=list)  # generated tokens of each task's tree
    # Tokens the trainer forwards and back-propagates per tree: one row per leaf (verl's layout: prompt + response,
    # the response cut at ``response_length``), and the tree packed into one row (``bpo.packed``,
    # :func:`~verl_bpo.core.packing.pack_tree`: the prompt and each unique response token once, plus bridges).
    trained_tokens_leaf: float = 0.0
    trained_tokens_packed: float = 0.0


def trained_tokens(result: TreeResult, response_length: int) -> tuple[int, int]:
    """One tree's trained tokens in the leaf layout and packed (:class:`StepStats`). A flat group packs too (its
    leaves share the prompt); which layout an estimator trains with is the caller's to say."""
    rows = [LeafTokens(np.asarray(leaf.transcript.token_ids[: leaf.transcript.prompt_length]),
                       np.asarray(leaf.transcript.response_ids[:response_length]), leaf.meta)
            for leaf in result.leaves]
    if not rows:  # a tree that never started trains nothing
        return 0, 0
    return sum(len(r.prompt) + len(r.response) for r in rows), len(pack_tree(rows).input_ids)


class LocalRL:
    """Trains ``model`` in place on ``sandbox`` tasks; see the module docstring for what is verl's and what is not."""

    def __init__(self, model: Any, tokenizer: Any, sandbox: str, sandbox_config: Mapping[str, Any],
                 config: LocalRLConfig, seed: int = 0) -> None:
        import torch
        from verl.trainer.ppo import core_algos

        self.model, self.tokenizer, self.config, self.seed = model, tokenizer, config, seed
        self.sandbox, self.sandbox_config = sandbox, dict(sandbox_config)
        self.client = BatchedHFClient(model, tokenizer, temperature=config.temperature)
        self.codec = TemplateCodec(tokenizer)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, eps=config.adam_eps)
        self.estimator_fn = core_algos.get_adv_estimator_fn(config.estimator)
        self.bpo = BPOConfig.from_mapping(config.bpo)
        self.policies: dict[str, ForkPolicy] = {}  # per estimator: what it learns carries across updates
        self.updates = 0

    # --- rollout ------------------------------------------------------------------------------------------------
    def rollout(self, tasks: Sequence[Mapping[str, Any]], rollout_n: int | None = None,
                estimator: str | None = None, budgets: Sequence[float] | None = None,
                stream: str = "train") -> list[TreeResult]:
        """One tree (or flat group) per task, all grown concurrently so their turns batch together. ``budgets``:
        each task's tree budget under a learned allocation (``None``: learned from earlier trees). ``stream``
        names the purpose the trees' seeds are drawn for, so that evaluation never replays a training draw."""
        n = rollout_n or self.config.rollout_n
        estimator = estimator or self.config.estimator
        self.client.forget()  # the cached keys and values are of the weights before the last update
        config = self.bpo.for_estimator(estimator)
        policy = self.policies.setdefault(estimator, ForkPolicy(config))

        async def grow_all() -> list[TreeResult]:
            samplers = [
                TreeSampler(config, n, self.config.response_length,
                            lambda: make_sandbox(self.sandbox, self.sandbox_config), task, self.client, self.codec,
                            tree_id=f"s{self.seed}-u{self.updates}-t{i}", policy=policy,
                            seed=derive_seed(self.seed, stream, self.updates, i),
                            root_budget=None if budgets is None else budgets[i], seeded_turns=True,
                            policy_learns=False)
                for i, task in enumerate(tasks)
            ]
            return list(await asyncio.gather(*(s.run() for s in samplers)))

        results = asyncio.run(grow_all())
        for result in results:  # in task order, as verl's trainer learns from a batch: not in the order trees finished
            if result.record is not None:
                policy.learn(result.record)
        return results

    def evaluate(self, tasks: Sequence[Mapping[str, Any]], episodes_per_task: int = 2) -> float:
        """Success rate of independent sampled episodes (flat groups) on ``tasks``."""
        results = self.rollout(tasks, rollout_n=episodes_per_task, estimator="grpo", stream="eval")
        return float(np.mean([r.metrics["bpo/success_rate"] for r in results]))

    # --- update -------------------------------------------------------------------------------------------------
    def _batch(self, results: list[TreeResult]) -> dict[str, Any]:
        """verl's row layout: one row per leaf, uid per tree, reward on the last response token."""
        import torch

        leaves: list[Leaf] = [leaf for r in results for leaf in r.leaves]
        uids = np.array([leaf.meta.tree_id for leaf in leaves], dtype=object)
        length = max(len(leaf.transcript.response_mask) for leaf in leaves)
        mask = torch.zeros(len(leaves), length)
        rewards = torch.zeros(len(leaves), length)
        for i, leaf in enumerate(leaves):
            m = leaf.transcript.response_mask[: self.config.response_length]
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
            rewards[i, len(m) - 1] = leaf.reward
        return {"leaves": leaves, "uid": uids, "response_mask": mask, "token_level_rewards": rewards}

    def _advantages(self, batch: dict[str, Any]) -> Any:
        kwargs = {"token_level_rewards": batch["token_level_rewards"], "response_mask": batch["response_mask"],
                  "index": batch["uid"], "config": {"gamma": self.config.gamma}}
        if self.config.estimator == "bpo":
            trees = len(set(batch["uid"].tolist()))
            kwargs.update(tree_meta=[leaf.meta for leaf in batch["leaves"]], bpo_config=self.bpo,
                          rows_per_tree=rows_per_tree(len(batch["leaves"]), trees))
        advantages, _ = self.estimator_fn(**kwargs)
        return advantages

    def _response_log_probs(self, leaves: list[Leaf], length: int) -> Any:
        """Log-probs of every response token under the current weights, ``(leaves, length)``."""
        import torch

        full = [leaf.transcript.token_ids[: leaf.transcript.prompt_length + length] for leaf in leaves]
        width = max(len(ids) for ids in full)
        ids = torch.full((len(full), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, seq in enumerate(full):
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        token_logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        # Position p predicts token p + 1: a leaf's response token j sits at prompt_length + j.
        starts = torch.tensor([leaf.transcript.prompt_length - 1 for leaf in leaves]).unsqueeze(1)
        index = (starts + torch.arange(length)).clamp(max=width - 2)
        return token_logp.gather(1, index)

    def gradient(self, results: list[TreeResult]) -> tuple[float, dict[str, Any]]:
        """Backpropagate verl's policy-gradient loss for these rollouts; returns the pre-clip gradient norm and
        the batch (the gradient stays in ``.grad`` for :meth:`step` or for a variance measurement)."""
        import torch

        batch = self._batch(results)
        advantages = self._advantages(batch)
        mask = batch["response_mask"]
        self.model.train()
        log_probs = self._response_log_probs(batch["leaves"], mask.shape[1])
        # One on-policy step: old log-probs are the current ones (ratio 1), as verl's first mini-batch sees them.
        loss = actor_loss(log_probs, log_probs.detach(), advantages, mask, loss_agg_mode=self.config.loss_agg_mode,
                          global_batch_size=mask.shape[0], loss_scale_factor=self.config.response_length)
        self.optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        batch["advantages"] = advantages
        return norm, batch

    def flat_gradient(self) -> np.ndarray:
        """The current ``.grad`` of every parameter as one vector."""
        return np.concatenate([p.grad.detach().reshape(-1).numpy() for p in self.model.parameters()
                               if p.grad is not None])

    def step(self, tasks: Sequence[Mapping[str, Any]], budgets: Sequence[float] | None = None) -> StepStats:
        """One policy update on one batch of tasks (``budgets``: see :meth:`rollout`)."""
        import torch

        results = self.rollout(tasks, budgets=budgets)
        norm, batch = self.gradient(results)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.updates += 1
        zero = (batch["advantages"] * batch["response_mask"]).abs().sum(-1) == 0

        def mean(key: str) -> float:
            return float(np.mean([r.metrics[key] for r in results]))

        trained = np.array([trained_tokens(r, self.config.response_length) for r in results], dtype=float)

        return StepStats(
            success_rate=mean("bpo/success_rate"),
            leaf_return=mean("bpo/leaf_return"),
            grad_norm=norm,
            env_steps=mean("bpo/env_steps"),
            generated_tokens=mean("bpo/generated_tokens"),
            trainer_rows=mean("bpo/trainer_rows"),
            zero_advantage_share=float(zero.float().mean()),
            tree_tokens=[float(r.metrics["bpo/generated_tokens"]) for r in results],
            trained_tokens_leaf=float(trained[:, 0].mean()),
            trained_tokens_packed=float(trained[:, 1].mean()),
        )
