"""Tree attention over packed trees equals the dense attention rule, and a packed row scores like its leaf rows.

- The blocked, grouped attention equals softmax attention under the explicit N×N mask of the rule (values and
  gradients), on random forests with forks at several depths, bridges, padding, GQA and one or two rows.
- Its cost: the computed pairs stay within the grouping bound, and the allowed pairs undercut the leaf rows'.
- A tiny Qwen2 fed one packed row under :func:`packed_trees` gives every leaf token the next-token logits its leaf
  row gives it; without a plan the hooked attention is the original, bit for bit. Layers that gradient
  checkpointing recomputes during backward find the plan too, on an autograd worker thread as well.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from verl_bpo.integration.tree_attention import (
    TreeAttentionPlan,
    check_supported,
    install,
    packed_trees,
    tree_attention_forward,
)


@dataclasses.dataclass
class Layout:
    """A flat layout of packed trees: per position its segment (-1 padding) and key flag, per segment its parent."""

    segment: list[int] = dataclasses.field(default_factory=list)
    is_key: list[bool] = dataclasses.field(default_factory=list)
    parent: list[int] = dataclasses.field(default_factory=list)

    def add(self, parent: int, n: int, key: bool = True) -> int:
        self.parent.append(parent)
        self.segment += [len(self.parent) - 1] * n
        self.is_key += [key] * n
        return len(self.parent) - 1

    def pad(self, n: int) -> None:
        self.segment += [-1] * n
        self.is_key += [False] * n

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(self.segment), torch.tensor(self.parent, dtype=torch.long), torch.tensor(self.is_key)


def grow(rng: np.random.Generator, layout: Layout, parent: int, depth: int) -> None:
    """One random subtree in depth-first order, a bridge before every child but the first."""
    seg = layout.add(parent, int(rng.integers(1, 5)))
    n_children = int(rng.integers(2, 4)) if depth == 0 else int(rng.integers(0, 3)) if depth < 3 else 0
    for i in range(n_children):
        if i:
            layout.add(seg, 1, key=False)
        grow(rng, layout, seg, depth + 1)


def random_layout(rng: np.random.Generator, rows: int) -> tuple[Layout, int]:
    """``rows`` rows padded to one length (returned too), each a forest of 1-2 trees, plus a lone query-only root
    (it sees nothing, so its output must be 0) in the first row."""
    forests = []
    for row in range(rows):
        layout = Layout()
        if rng.random() < 0.5:
            layout.pad(int(rng.integers(1, 3)))  # left padding
        if row == 0:
            layout.add(-1, 1, key=False)
        for _ in range(int(rng.integers(1, 3))):
            grow(rng, layout, -1, 0)
        forests.append(layout)
    length = max(len(f.segment) for f in forests) + 1
    out = Layout()
    for f in forests:
        shift = len(out.parent)
        out.parent += [p + shift if p >= 0 else -1 for p in f.parent]
        out.segment += [s + shift if s >= 0 else -1 for s in f.segment]
        out.is_key += f.is_key
        out.pad(length - len(f.segment))
    return out, length


def dense_mask(segment: torch.Tensor, parent: torch.Tensor, is_key: torch.Tensor) -> torch.Tensor:
    """``(N, N)`` the attention rule, written out pair by pair."""
    def ancestors(s: int) -> set[int]:
        out = set()
        while parent[s] >= 0:
            s = int(parent[s])
            out.add(s)
        return out

    n = len(segment)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        s = int(segment[i])
        if s < 0:
            continue
        up = ancestors(s)
        for j in range(n):
            sj = int(segment[j])
            mask[i, j] = bool(is_key[j]) and (sj in up or (sj == s and j <= i))
    return mask


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """Softmax attention of the flattened batch under ``mask``; rows that see nothing give 0."""
    batch, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k = key.transpose(1, 2).reshape(batch * length, -1, dim).repeat_interleave(heads // key.shape[1], dim=1)
    v = value.transpose(1, 2).reshape(batch * length, -1, dim).repeat_interleave(heads // key.shape[1], dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scaling
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", weights, v).reshape(batch, length, heads, dim)


@pytest.mark.parametrize("rows, block", [(1, 256), (2, 256), (2, 2), (3, 3)])
def test_equals_the_dense_rule(rows: int, block: int) -> None:
    layout, length = random_layout(np.random.default_rng(rows * 10 + block), rows)
    segment, parent, is_key = layout.tensors()
    plan = TreeAttentionPlan.build(segment, parent, is_key, block=block)
    mask = dense_mask(segment, parent, is_key)
    assert plan.exact_pairs == int(mask.sum())
    gen = torch.Generator().manual_seed(block)
    q, k, v = (torch.randn(rows, heads, length, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for heads in (4, 2, 2))
    upstream = torch.randn(rows, length, 4, 8, generator=gen, dtype=torch.float64)

    out = tree_attention_forward(q, k, v, plan, scaling=0.3)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    ref = dense_attention(q, k, v, mask, scaling=0.3)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))

    assert out.shape == (rows, length, 4, 8)
    assert (out - ref).abs().max() <= 1e-6
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= 1e-6
    flat = out.reshape(rows * length, 4, 8)
    assert (flat[segment < 0] == 0).all()
    assert (flat[~mask.any(dim=1)] == 0).all()  # the lone query-only root


def leaf_rows_causal_pairs(layout: Layout) -> int:
    """Σ over leaves of L(L+1)/2: what one causal row per leaf attends."""
    seg = np.array(layout.segment)
    sizes = np.bincount(seg[seg >= 0], minlength=len(layout.parent))
    bridge = [not layout.is_key[layout.segment.index(s)] for s in range(len(layout.parent))]
    path = [0] * len(layout.parent)
    has_child = [False] * len(layout.parent)
    for s, p in enumerate(layout.parent):
        path[s] = (path[p] if p >= 0 else 0) + sizes[s]
        if p >= 0 and not bridge[s]:
            has_child[p] = True
    return sum(path[s] * (path[s] + 1) // 2 for s in range(len(layout.parent)) if not bridge[s] and not has_child[s])


@pytest.mark.parametrize("block, slack", [(256, 1.25), (16, 1.25), (4, 1.5)])
def test_cost_bounds(block: int, slack: float) -> None:
    shared = Layout()
    prompt = shared.add(-1, 60)
    for i in range(4):
        if i:
            shared.add(prompt, 1, key=False)
        shared.add(prompt, 15)
    forest, _ = random_layout(np.random.default_rng(7), 2)
    for layout in (shared, forest):
        segment, parent, is_key = layout.tensors()
        plan = TreeAttentionPlan.build(segment, parent, is_key, block=block, slack=slack)
        queries = int((segment >= 0).sum())
        assert plan.exact_pairs <= plan.padded_pairs <= slack * (plan.exact_pairs + queries * (block - 1) / 2)
        assert plan.exact_pairs <= leaf_rows_causal_pairs(layout)
    segment, parent, is_key = shared.tensors()
    exact = TreeAttentionPlan.build(segment, parent, is_key).exact_pairs
    # the prompt's causal pairs once, each leaf's 15 rows over the prompt and itself, each bridge over the prompt
    assert exact == 60 * 61 // 2 + 4 * (15 * 60 + 15 * 16 // 2) + 3 * 60
    assert exact < leaf_rows_causal_pairs(shared) == 4 * 75 * 76 // 2


@pytest.mark.parametrize("segment, parent, message", [
    ([0, 0, 1, 0], [-1, 0], "not contiguous"),
    ([0, 1, 1], [1, -1], "earlier segment"),
    ([0, 0, 0], [0], "earlier segment"),
    ([0, 2], [-1, 0], r"\[-1, 2\)"),
])
def test_invalid_plans(segment: list[int], parent: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TreeAttentionPlan.build(torch.tensor(segment), torch.tensor(parent), torch.ones(len(segment), dtype=torch.bool))


def test_check_supported() -> None:
    check_supported("sdpa")
    check_supported("flash_attention_2")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.override_config\.attn_implementation"):
        check_supported("eager")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention registry as transformers ships it, restored after the test (install() is process-wide)."""
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    monkeypatch.setattr(ALL_MASK_ATTENTION_FUNCTIONS, "_local_mapping", dict(ALL_MASK_ATTENTION_FUNCTIONS._local_mapping))


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float().eval()


# Three leaves, P+x+y1, P+x+y2 and P+z, packed as P x y1 [x's last] y2 [P's last] z.
P, X, Y1, Y2, Z = [5, 17, 33, 2], [41, 8], [60, 71, 3], [12, 90], [55, 24, 66]
LEAVES = [P + X + Y1, P + X + Y2, P + Z]


def packed_tree() -> tuple[Layout, list[int], list[int], list[list[int]]]:
    """The layout, input ids, position ids and, per leaf, the packed position of each of its tokens."""
    layout = Layout()
    ids, pos = [], []

    def put(parent: int, tokens: list[int], start: int, key: bool = True) -> tuple[int, list[int]]:
        seg = layout.add(parent, len(tokens), key)
        at = list(range(len(ids), len(ids) + len(tokens)))
        ids.extend(tokens)
        pos.extend(range(start, start + len(tokens)))
        return seg, at

    p, at_p = put(-1, P, 0)
    x, at_x = put(p, X, 4)
    _, at_y1 = put(x, Y1, 6)
    put(x, X[-1:], 5, key=False)
    _, at_y2 = put(x, Y2, 6)
    put(p, P[-1:], 3, key=False)
    _, at_z = put(p, Z, 4)
    return layout, ids, pos, [at_p + at_x + at_y1, at_p + at_x + at_y2, at_p + at_z]


def logits(model: Qwen2ForCausalLM, ids: list[list[int]], **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), **kwargs).logits


@pytest.mark.parametrize("batch", [1, 2])
def test_packed_row_scores_like_its_leaf_rows(registry, batch: int) -> None:
    model = tiny_qwen2()
    before = logits(model, [LEAVES[0]])
    install()
    install()
    assert not hasattr(ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__, "__wrapped__")  # wrapped once
    assert torch.equal(logits(model, [LEAVES[0]]), before)  # no plan: the original attention
    leaf_logits = [logits(model, [leaf])[0] for leaf in LEAVES]

    layout, ids, pos, at = packed_tree()
    length = len(ids) + 2
    layout.pad(2)
    ids, pos, mask = [ids + [0, 0]], [pos + [0, 0]], [[1] * (length - 2) + [0, 0]]
    if batch == 2:  # a second, ordinary row: one root segment, then padding
        other = [7, 3, 9, 11, 50, 1, 88, 20, 4, 19]
        layout.add(-1, len(other))
        layout.pad(length - len(other))
        ids.append(other + [0] * (length - len(other)))
        pos.append(list(range(len(other))) + [0] * (length - len(other)))
        mask.append([1] * len(other) + [0] * (length - len(other)))
    plan = TreeAttentionPlan.build(*layout.tensors())
    with packed_trees(plan):
        packed = logits(model, ids, position_ids=torch.tensor(pos), attention_mask=torch.tensor(mask))

    for leaf, leaf_at, row in zip(LEAVES, at, leaf_logits):
        # leaf position t predicts token t + 1: packed, the position just before that token's (a bridge if it
        # starts a later sibling); the last token's own logits are its own position's
        predictors = [a - 1 for a in leaf_at[1:]] + [leaf_at[-1]]
        assert (packed[0, predictors] - row).abs().max() <= 1e-5, leaf
    if batch == 2:
        alone = logits(model, [other])[0]
        assert (packed[1, :len(other)] - alone).abs().max() <= 1e-5


def test_checkpointed_backward_inside_the_context(registry) -> None:
    """Gradient checkpointing recomputes the attention during backward, which must run inside the context."""
    install()
    layout, ids, pos, _ = packed_tree()
    plan = TreeAttentionPlan.build(*layout.tensors())
    grads = []
    for checkpointing in (False, True):
        model = tiny_qwen2().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with packed_trees(plan):
            model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos])).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max() <= 1e-6


def test_plan_reaches_autograd_worker_threads(registry) -> None:
    """A GPU backward recomputes checkpointed layers on a worker thread with empty context variables; autograd
    hands it the launching context in its thread-local state, as simulated here, and the plan is read from it."""
    install()
    layout, _, _, _ = packed_tree()
    plan = TreeAttentionPlan.build(*layout.tensors())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, plan.size, 8, generator=gen) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    with packed_trees(plan):
        launching = contextvars.copy_context()
    results = {}

    def worker() -> None:
        results["bare"] = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, scaling=0.5)[0]
        torch._C._stash_obj_in_tls("context", launching)
        try:
            results["backward"] = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, scaling=0.5)[0]
        finally:
            torch._C._remove_obj_from_tls("context")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert torch.equal(results["backward"], tree_attention_forward(q, k, v, plan, scaling=0.5))
    assert not torch.allclose(results["bare"], results["backward"])  # no plan there: plain causal attention
