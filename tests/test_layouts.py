"""T5: the leaf row layout (what the estimator emits) and the segment layout give identical parameter gradients.

A tiny causal LM (embedding + GRU + head) scores a random BPO tree two ways:
- leaf rows: one row per leaf, shared prefixes duplicated, token advantage N · w_leaf · A_segment (the estimator);
- segment rows: one row per segment, its prefix as masked context, token advantage N · W_e · A_e.
Both losses are Σ_rows Σ_tokens Ã · log π / N; their gradients must agree to 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trees import random_tree_paths
from verl_bpo.integration.estimator import compute_bpo_advantage
from verl_bpo.core.tree import Forest, compute_credit
from verl_bpo.core.leaf_meta import LeafMeta

VOCAB = 23


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.gru = torch.nn.GRU(8, 16, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)

    def token_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """log π(tokens[:, t] | tokens[:, :t]) for t >= 1; column 0 is 0."""
        hidden, _ = self.gru(self.embed(tokens[:, :-1]))
        logp = torch.log_softmax(self.head(hidden), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
        return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def loss_grad(model: TinyLM, rows: list[tuple[list[int], list[float]]], n_leaves: int) -> list[torch.Tensor]:
    model.zero_grad()
    length = max(len(t) for t, _ in rows)
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    adv = torch.zeros(len(rows), length)
    for i, (t, a) in enumerate(rows):
        tokens[i, : len(t)] = torch.tensor(t)
        adv[i, : len(a)] = torch.tensor(a)
    loss = (adv * model.token_logprobs(tokens)).sum() / n_leaves  # seq-mean-token-sum over N rows of a tree
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


# seed 0 in the fast tier, the others `slow`
@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s == 0 else pytest.mark.slow) for s in range(4)])
def test_T5_leaf_and_segment_layouts_give_identical_gradients(seed):
    rng = np.random.default_rng(seed)
    parent, leaves = random_tree_paths(rng, n_leaves=7, k0=2, k_choices=(2, 3), horizon=4)
    n = len(leaves)
    turn = {node: list(rng.integers(1, VOCAB, size=rng.integers(1, 4))) for node in range(1, len(parent))}
    env = {node: list(rng.integers(1, VOCAB, size=rng.integers(0, 3))) for node in range(1, len(parent))}
    reward = rng.normal(size=len(parent))
    prompt = list(rng.integers(1, VOCAB, size=3))

    # Leaf rows through the registered estimator.
    forest = Forest(np.array(parent), reward)
    credit = compute_credit(forest)
    metas, responses = [], []
    for leaf_id, path in enumerate(leaves):
        response, spans = [], []
        for node in path[1:]:
            spans.append((len(response), len(response) + len(turn[node])))
            response += turn[node] + env[node]
        metas.append(LeafMeta("t", leaf_id, tuple(path), tuple(spans), float(credit.mass[path[-1]]),
                              tuple(float(reward[x]) for x in path[1:])))
        responses.append(response)
    length = max(map(len, responses))
    mask = torch.zeros(n, length)
    rewards = torch.zeros(n, length)  # as verl lays them out: the row's return on its last response token
    for i, m in enumerate(metas):
        for s, e in m.turn_spans:
            mask[i, s:e] = 1
        rewards[i, len(responses[i]) - 1] = sum(m.turn_rewards)
    adv, _ = compute_bpo_advantage(rewards, mask, index=np.array(["t"] * n, dtype=object), tree_meta=metas)
    leaf_rows = [(prompt + r, [0.0] * len(prompt) + adv[i, : len(r)].tolist()) for i, r in enumerate(responses)]

    # Segment rows straight from the tree credit.
    segment_rows = []
    for top in np.flatnonzero(credit.segment_top == np.arange(len(parent))):
        members = [x for x in range(1, len(parent)) if credit.segment_top[x] == top]
        path, x = [], int(parent[top])
        while x > 0:
            path.append(x)
            x = parent[x]
        context = prompt + [tok for node in reversed(path) for tok in turn[node] + env[node]]
        tokens, weights = list(context), [0.0] * len(context)
        value = n * credit.mass[top] * credit.advantage[top]
        for node in members:  # parents before children: the chain in order
            tokens += turn[node] + env[node]
            weights += [value] * len(turn[node]) + [0.0] * len(env[node])
        segment_rows.append((tokens, weights))

    torch.manual_seed(0)
    model = TinyLM()
    for g_leaf, g_seg in zip(loss_grad(model, leaf_rows, n), loss_grad(model, segment_rows, n)):
        torch.testing.assert_close(g_leaf, g_seg, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in loss_grad(model, leaf_rows, n))
