"""The production gradient path, driven end to end on the tabular oracle (no Ray, no GPU).

    verl_bpo's bpo_tree agent loop (sessions launched as verl's v1 worker launches them)
      → TreeSampler growing real trees in the tabular sandbox, served by the tabular softmax policy
      → AgentLoopOutput.as_dict() rows, stacked and padded as verl's trainer holds them
      → the BPO trainer's estimator context (batch_tree_call) around verl's own compute_advantage
      → verl's ppo_loss on verl's actor config, per data-parallel rank, as verl's actor calls it (actor_loss)
      → autograd on per-tree copies of θ: one backward gives every tree's gradient.

Only the tokenizer of the continuous-token builder is replaced: the tabular codec puts one token per state and
per action, which makes every log-probability exact (see verl_bpo.oracle.policy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Callable

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

from verl_bpo.core.config import BPOConfig
from verl_bpo.integration.actor_loss import actor_loss
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.integration.agent_loop import STATE_KEY, BPOTreeAgentLoop
from verl_bpo.integration.batch_layout import minibatch_rows
from verl_bpo.integration.packed_rows import pack_rows, packed_advantages, packed_mask
from verl_bpo.integration.trainer import batch_tree_call, learn_from_batch, rollout_states
from verl_bpo.oracle.mdp import TabularMDP, exact_gradient, problem
from verl_bpo.oracle.policy import TabularCodec, TabularPolicy
from verl_bpo.oracle.sandbox import TabularSandbox  # noqa: F401  (registers "tabular")


@dataclasses.dataclass(frozen=True)
class Case:
    """One production-path setting: the problem, the tree, and verl's loss settings."""

    name: str
    problem: str
    problem_args: dict
    bpo: dict
    n: int = 7
    sessions: int | None = None  # agent-loop sessions per task (the trainer's __rollout_n__); default n
    fail_prob: float = 0.0
    gamma: float = 1.0
    loss_agg_mode: str = "seq-mean-token-sum"
    loss_scale_factor: int | None = None
    dp_size: int = 2
    batch_trees: int = 64
    sandbox: str = "tabular"  # the registered sandbox: the tabular one, or a (fault-injecting) subclass of it
    sandbox_config: dict = dataclasses.field(default_factory=dict)  # its Config keys beyond the problem's
    packed: bool = False  # the actor trains packed trees (bpo.packed): one row per tree, each token once

    @property
    def mdp_theta(self) -> tuple[TabularMDP, np.ndarray]:
        return problem(self.problem, **self.problem_args)

    def exact(self) -> np.ndarray:
        """∇J of the MDP in which a step fails for good (ending the episode with reward 0) with probability
        ``fail_prob ** (1 + bpo.step_retries)``: the tabular sandbox draws a crash afresh on every attempt, and a
        retry re-seeds it."""
        mdp, theta = self.mdp_theta
        return exact_gradient(mdp, theta, self.fail_prob ** (1 + self.bpo_config().step_retries))[1]

    def bpo_config(self) -> BPOConfig:
        return BPOConfig.from_mapping(self.bpo)


@dataclasses.dataclass
class Batch:
    """One trainer batch of leaf rows, padded as verl pads it, with its advantages and per-tree gradients."""

    uids: list[str]
    extra_fields: list[dict]
    prompts: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    token_level_rewards: torch.Tensor
    advantages: torch.Tensor | None = None
    tree_of_row: np.ndarray | None = None
    trees: list[str] = dataclasses.field(default_factory=list)

    @property
    def leaves_per_tree(self) -> np.ndarray:
        return np.bincount(self.tree_of_row[self.tree_of_row >= 0], minlength=len(self.trees))


def trainer_config(case: Case, response_length: int = 64):
    sandbox = {"name": case.sandbox, "config": {"problem": case.problem, "problem_args": case.problem_args,
                                                "fail_prob": case.fail_prob, **case.sandbox_config}}
    return OmegaConf.create({
        "algorithm": {"adv_estimator": "bpo", "gamma": case.gamma, "lam": 1.0},
        "actor_rollout_ref": {"rollout": {"prompt_length": 8, "response_length": response_length, "n": case.n,
                                          "multi_turn": {}, "agent": {}}},
        "data": {},
        "bpo": {**case.bpo, "sandbox": sandbox},
    })


class TabularAgentLoop(BPOTreeAgentLoop):
    """The production agent loop with the tabular codec in place of the continuous-token builder."""

    codec: TabularCodec | None = None

    def make_codec(self) -> TabularCodec:
        return self.codec


def grow_batch(case: Case, tokenizer, client: TabularPolicy, first_uid: int,
               policy: ForkPolicy) -> list[tuple[str, list]]:
    """``case.batch_trees`` trees through the agent loop, all sessions at once (as verl's worker runs a batch),
    each row carrying ``policy``'s state as the BPO trainer hands it out."""
    config = trainer_config(case)
    extra_info = {"task": json.dumps({})}
    (state,) = rollout_states(policy, case.sessions or case.n, [extra_info], config.bpo.sandbox)
    mdp, _ = case.mdp_theta
    TabularAgentLoop.codec = TabularCodec(mdp)

    def session(uid: str, i: int):
        loop = TabularAgentLoop(trainer_config=DictConfigWrap(config), server_manager=client, tokenizer=tokenizer,
                                processor=None, dataset_cls=None, data_config=DictConfigWrap(config.data),
                                hf_model_type="qwen2")
        return loop.run({"temperature": 1.0, "logprobs": True}, uid=uid, session_id=i, index=0,
                        extra_info=extra_info, **{STATE_KEY: state})

    async def run_all():
        uids = [f"u{first_uid + j}" for j in range(case.batch_trees)]
        tasks = [[asyncio.create_task(session(uid, i)) for i in range(case.sessions or case.n)] for uid in uids]
        return [(uid, await asyncio.gather(*ts)) for uid, ts in zip(uids, tasks)]

    return asyncio.run(run_all())


def to_rows(grown: list[tuple[str, list]], pad_multiple: int) -> Batch:
    """AgentLoopOutput → verl's row fields (``as_dict``), padded to ``pad_multiple`` rows with verl-style padding
    rows (a ``pad…`` uid, a zero mask, a copy of row 0's extra fields)."""
    uids, extras, prompts, responses, masks, scores = [], [], [], [], [], []
    for uid, outputs in grown:
        for out in outputs:
            if isinstance(out, list):  # a session without a leaf returns an empty list
                assert not out
                continue
            field = out.as_dict()
            uids.append(uid)
            extras.append(field["extra_fields"])
            prompts.append(field["prompts"])
            responses.append(field["responses"])
            masks.append(field["response_mask"])
            scores.append(field["rm_scores"])
    while len(uids) % pad_multiple:
        uids.append(f"pad{len(uids)}")
        extras.append(extras[0])
        prompts.append(prompts[0])
        responses.append(responses[0][:1])
        masks.append(torch.zeros(1, dtype=torch.int64))
        scores.append(torch.zeros(1))
    pad = torch.nn.utils.rnn.pad_sequence
    trees = list(dict.fromkeys(u for u in uids if not u.startswith("pad")))
    index = {t: i for i, t in enumerate(trees)}
    return Batch(uids, extras, pad(prompts, batch_first=True), pad(responses, batch_first=True),
                 pad(masks, batch_first=True), pad(scores, batch_first=True).float(),
                 tree_of_row=np.array([index.get(u, -1) for u in uids]), trees=trees)


def to_packed(batch: Batch, advantages: torch.Tensor, pad_multiple: int) -> Batch:
    """The BPO trainer's packed rows (``bpo.packed``, verl_bpo/integration/packed_rows.py) of a leaf batch: one row
    per tree with its copies' summed advantages times packed rows / leaf rows, padded to ``pad_multiple`` rows."""
    rows = lambda t: [r.numpy() for r in t]  # noqa: E731
    lengths = [int(e["bpo"]["turn_spans"][-1][1]) if not u.startswith("pad") else 1
               for u, e in zip(batch.uids, batch.extra_fields)]
    responses = [r[:n] for r, n in zip(rows(batch.responses), lengths)]
    grouped = pack_rows(batch.uids, batch.extra_fields, rows(batch.prompts), responses)
    n_packed = len(grouped) + (-len(grouped) % pad_multiple)
    scale = n_packed / len(batch.uids)
    adv = [a[:n] for a, n in zip(rows(advantages.double()), lengths)]
    masks = [m[:n] for m, n in zip(rows(batch.response_mask), lengths)]
    uids, prompts, responses_p, masks_p, adv_p = [], [], [], [], []
    for uid, idx, tree in grouped:
        uids.append(uid)
        prompts.append(torch.as_tensor(tree.input_ids[:tree.prompt_len]))
        responses_p.append(torch.as_tensor(tree.input_ids[tree.prompt_len:]))
        masks_p.append(torch.as_tensor(packed_mask(tree, [masks[i] for i in idx]), dtype=torch.int64))
        adv_p.append(torch.as_tensor(packed_advantages(tree, [adv[i] for i in idx], scale)))
    while len(uids) < n_packed:
        uids.append(f"pad{len(uids)}")
        prompts.append(prompts[0])
        responses_p.append(responses_p[0][:1])
        masks_p.append(torch.zeros(1, dtype=torch.int64))
        adv_p.append(torch.zeros(1, dtype=torch.float64))
    pad = torch.nn.utils.rnn.pad_sequence
    index = {t: i for i, t in enumerate(batch.trees)}
    packed = Batch(uids, [{}] * len(uids), pad(prompts, batch_first=True), pad(responses_p, batch_first=True),
                   pad(masks_p, batch_first=True), torch.zeros(len(uids), 1), trees=batch.trees,
                   tree_of_row=np.array([index.get(u, -1) for u in uids]))
    packed.advantages = pad(adv_p, batch_first=True).float()
    return packed


def advantages(case: Case, batch: Batch) -> torch.Tensor:
    """The BPO trainer's advantage step: batch_tree_call around verl's compute_advantage_for_multi_trajectories."""
    config = trainer_config(case)
    data = DataProto.from_dict(tensors={"token_level_rewards": batch.token_level_rewards,
                                        "response_mask": batch.response_mask},
                               non_tensors={"uid": np.array(batch.uids, dtype=object)})
    keys = [f"{u}_{i}_0" for i, u in enumerate(batch.uids)]
    with batch_tree_call(batch.uids, batch.extra_fields, OmegaConf.to_container(config.bpo)):
        data = compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator="bpo", gamma=case.gamma, lam=1.0, num_repeat=case.n,
            config=config.algorithm)
    batch.advantages = data.batch["advantages"]
    return batch.advantages


def tree_gradients(case: Case, batch: Batch, advantages: torch.Tensor | None = None) -> np.ndarray:
    """Each tree's gradient estimate ĝ_i, ``(B, T, X, A)``, from verl's actor loss of one mini-batch.

    The loss is verl's ``ppo_loss`` on each of ``case.dp_size`` data-parallel ranks (``global_batch_size`` = the
    mini-batch's rows), the ranks' gradients averaged as DDP/FSDP averages them (actor_loss). Every row reads log π
    from its own tree's copy of θ, so the batch loss's gradient with respect to copy i is the tree's share;
    ĝ_i = −B · (loss_scale_factor) · ∂loss/∂θ_i is the tree's own estimate of ∇J.
    """
    mdp, theta = case.mdp_theta
    codec = TabularCodec(mdp)
    adv = batch.advantages if advantages is None else advantages
    rows, length = batch.responses.shape
    B = len(batch.trees)
    theta_rep = torch.tensor(np.broadcast_to(theta, (B, *theta.shape)).copy(), requires_grad=True)
    mask = batch.response_mask.bool()
    previous = torch.cat([batch.prompts[:, -1:], batch.responses[:, :-1]], dim=1)  # the state before each token
    state = (previous - codec.n_actions).clamp(min=0)
    t, x = state // codec.n_outcomes, state % codec.n_outcomes
    tree = torch.as_tensor(np.maximum(batch.tree_of_row, 0))[:, None].expand(rows, length)
    valid = mask & (batch.responses < codec.n_actions)
    t, x = t.where(valid, 0).clamp(max=mdp.horizon - 1), x.where(valid, 0)
    logits = theta_rep[tree, t, x]  # (rows, length, A)
    action = batch.responses.where(valid, 0)
    log_prob = torch.log_softmax(logits, -1).gather(-1, action[..., None])[..., 0].where(valid, 0.0).float()
    loss = actor_loss(log_prob, log_prob.detach(), adv.float(), mask, loss_agg_mode=case.loss_agg_mode,
                      global_batch_size=minibatch_rows(rows, 1), loss_scale_factor=case.loss_scale_factor,
                      dp_size=case.dp_size)
    loss.backward()
    scale = case.loss_scale_factor if case.loss_agg_mode == "seq-mean-token-sum-norm" else 1.0
    return -B * scale * theta_rep.grad.double().numpy()


def run_case(case: Case, tokenizer, n_trees: int, seed: int,
             transform: Callable[[Batch, torch.Tensor], torch.Tensor] | None = None,
             controls: dict[str, Callable[[Batch, torch.Tensor], torch.Tensor]] | None = None,
             ) -> tuple[np.ndarray, dict[str, np.ndarray], list[Batch]]:
    """Per-tree gradients of ``n_trees`` trees (and of each control's advantages on the same trees)."""
    mdp, theta = case.mdp_theta
    client = TabularPolicy(theta, TabularCodec(mdp), seed=seed)
    policy = ForkPolicy(case.bpo_config().for_estimator("bpo"))  # the run's state: learns from this run's trees only
    grads, control_grads, batches = [], {k: [] for k in controls or {}}, []
    for start in range(0, n_trees, case.batch_trees):
        grown = grow_batch(case, tokenizer, client, first_uid=seed * 10**7 + start, policy=policy)
        batch = to_rows(grown, pad_multiple=case.dp_size * 4)
        learn_from_batch(policy, batch.uids, batch.extra_fields)  # as the BPO trainer learns after each rollout
        adv = advantages(case, batch)
        grads.append(train(case, batch, adv))
        for name, control in (controls or {}).items():
            control_grads[name].append(train(case, batch, control(batch, adv)))
        if len(batches) < 4:
            batches.append(batch)
    return (np.concatenate(grads), {k: np.concatenate(v) for k, v in control_grads.items()}, batches)


def train(case: Case, batch: Batch, advantages: torch.Tensor) -> np.ndarray:
    """Per-tree gradients of the rows the actor trains: the leaf rows, or their packed trees."""
    if case.packed:
        packed = to_packed(batch, advantages, pad_multiple=case.dp_size)
        return tree_gradients(case, packed)
    return tree_gradients(case, batch, advantages)


def z_scores(grads: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(mean − truth) / standard error per coordinate a tree can touch."""
    flat = grads.reshape(len(grads), -1)
    se = flat.std(axis=0, ddof=1) / math.sqrt(len(flat))
    live = se > 0
    return (flat.mean(axis=0)[live] - truth.ravel()[live]) / se[live]


def bonferroni(n_coords: int, alpha: float = 1e-4) -> float:
    """|z| bound for a family-wise false-alarm rate ``alpha`` over ``n_coords`` two-sided tests (at least 4)."""
    from statistics import NormalDist

    return max(4.0, NormalDist().inv_cdf(1 - alpha / (2 * n_coords)))
