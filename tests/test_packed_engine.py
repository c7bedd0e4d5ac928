"""verl's own engine code path trains a packed tree row exactly as it trains the tree's leaf rows.

One batch of trees goes through :class:`FSDPEngineWithPackedTrees` twice, as leaf rows (one per leaf) and as packed
rows (one per tree): verl's ``forward_backward_batch``, micro-batching, ``prepare_model_inputs``, a tiny Qwen2,
``prepare_model_outputs`` and ``ppo_loss``, under verl's padded layout, its remove-padding layout (with and without
its static padding) and its dynamic batch size. Only FSDP, Ray and the device are left out.

- Log-probs and entropies of every leaf token, read from the packed rows, equal the leaf rows' (forward-only, as
  verl computes old log-probs); the packed rows under plain causal attention do not, so the check has teeth.
- One training step: the parameter gradients of the packed rows (advantages summed over copies, times P / R)
  equal the leaf rows', at ratio 1 and with old log-probs perturbed so that PPO clips some tokens; with gradient
  checkpointing on, the recomputed layers in the backward still find the micro-batch's plan.

The trees fork at several depths, hold observations between turns (response mask 0), a failed last turn (mask and
advantage 0), rows truncated inside a shared node (whose copies are then not merged) and tokens before the first turn.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from verl.utils import seqlen_balancing
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import response_from_nested

from verl_bpo.core.leaf_meta import LeafMeta
from verl_bpo.core.packing import LeafTokens, PackedTree, pack_tree
from verl_bpo.integration import packed_engine
from verl_bpo.integration.packed_engine import FSDPEngineWithPackedTrees, install
from verl_bpo.integration.packed_rows import nested, packed_advantages, packed_fields, packed_mask

VOCAB = 97
TEMPERATURE = 0.7
FAILED = "failed"


@pytest.fixture(scope="module", autouse=True)
def verl_process(tmp_path_factory: pytest.TempPathFactory):
    """What a verl worker process has: one data-parallel group (here of one rank, gloo), the engine on the CPU,
    and the hooks of :func:`install`; the registries it changes are restored afterwards. One intra-op thread: the
    tensors are tiny, and a thread pool stalls for seconds on a machine whose cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
        mp.setattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
        mp.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
        mp.setattr(ALL_MASK_ATTENTION_FUNCTIONS, "_local_mapping", dict(ALL_MASK_ATTENTION_FUNCTIONS._local_mapping))
        mp.setattr(EngineRegistry, "_engines", {t: {b: dict(d) for b, d in by_backend.items()}
                                                for t, by_backend in EngineRegistry._engines.items()})
        for module in (transformer_impl, seqlen_balancing):
            mp.setattr(module, "get_device_name", lambda: "cpu")
        for module in (transformer_impl, packed_engine):
            mp.setattr(module, "get_device_id", lambda: "cpu")
        install()
        owned = not torch.distributed.is_initialized()
        if owned:
            path = tmp_path_factory.mktemp("pg") / "store"
            torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        try:
            yield
        finally:
            if owned:
                torch.distributed.destroy_process_group()
            torch.set_num_threads(threads)


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, initializer_range=0.1, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float()


def make_engine(model: Qwen2ForCausalLM, pad_to_length: bool) -> FSDPEngineWithPackedTrees:
    """The engine with only what its forward and backward read: no FSDP, no sequence parallelism, float32."""
    engine = FSDPEngineWithPackedTrees.__new__(FSDPEngineWithPackedTrees)
    engine.module = model
    engine.engine_config = FSDPEngineConfig()
    engine.ulysses_sequence_parallel_size = 1
    engine.ulysses_device_mesh = None
    engine.use_ulysses_sp = False
    engine.pad_to_length = pad_to_length
    engine.pad_to_length_bucket = 16
    engine._autocast_dtype = torch.float32
    engine.scaler = None
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


# ---------------------------------------------------------------------------------------------------------------
# The batch: trees given as nested (generated tokens, observation tokens, children[, FAILED]) turns.


@dataclasses.dataclass(frozen=True)
class Row:
    """A leaf row and, per response token, its response mask and the node its turn leads into (-1 before the
    first turn)."""

    tokens: LeafTokens
    mask: np.ndarray
    node: np.ndarray

    def truncated(self, leaf_id: int, length: int, mass: float) -> Row:
        """This row cut after ``length`` response tokens (a row that hit the response length limit)."""
        meta = self.tokens.meta
        turns = sum(start < length for start, _ in meta.turn_spans)
        spans = tuple((s, min(e, length)) for s, e in meta.turn_spans[:turns])
        meta = LeafMeta(meta.tree_id, leaf_id, meta.node_path[:turns + 1], spans, mass)
        return Row(LeafTokens(self.tokens.prompt, self.tokens.response[:length], meta), self.mask[:length],
                   self.node[:length])


def grow(rng: np.random.Generator, tree_id: str, turns: list, prompt_len: int, pre: int = 0) -> list[Row]:
    """The leaf rows of one tree; each leaf's mass is Π 1/K over the forks on its path."""
    prompt = rng.integers(1, VOCAB, prompt_len)
    before = rng.integers(1, VOCAB, pre)
    rows, next_node = [], [1]

    def walk(children: list, path: list[int], done: list, mass: float) -> None:
        for gen, obs, kids, *failed in children:
            node = next_node[0]
            next_node[0] += 1
            turn = (node, rng.integers(1, VOCAB, gen), rng.integers(1, VOCAB, obs), bool(failed))
            if kids:
                walk(kids, [*path, node], [*done, turn], mass / len(children))
            else:
                rows.append(leaf_row(tree_id, len(rows), prompt, before, [*done, turn], mass / len(children)))

    walk(turns, [0], [], 1.0)
    return rows


def leaf_row(tree_id: str, leaf_id: int, prompt: np.ndarray, before: np.ndarray, turns: list, mass: float) -> Row:
    response, mask, node, spans = [before], [np.zeros(len(before), np.int64)], [np.full(len(before), -1)], []
    at = len(before)
    for n, gen, obs, failed in turns:
        spans.append((at, at + len(gen)))
        response += [gen, obs]
        mask += [np.full(len(gen), 0 if failed else 1), np.zeros(len(obs), np.int64)]
        node.append(np.full(len(gen) + len(obs), n))
        at += len(gen) + len(obs)
    meta = LeafMeta(tree_id, leaf_id, (0, *(t[0] for t in turns)), tuple(spans), mass)
    return Row(LeafTokens(prompt, np.concatenate(response).astype(np.int64), meta),
               np.concatenate(mask).astype(np.int64), np.concatenate(node))


def forest(seed: int = 0) -> list[list[Row]]:
    rng = np.random.default_rng(seed)
    deep = grow(rng, "deep", [
        (3, 2, [(2, 2, [(2, 0, []), (3, 1, [])]),   # forks at the root, below node 1 and below node 2
                (2, 1, [])]),
        (3, 2, [(2, 0, []), (1, 2, [], FAILED)]),    # the last turn of the last leaf failed
    ], prompt_len=4)
    # cut inside the observation of node 2, which two other leaves share
    deep.append(deep[0].truncated(len(deep), 3 + 2 + 2 + 1, mass=0.2))
    early = grow(rng, "early", [(3, 3, [(2, 0, []), (2, 1, [])]), (2, 0, [])], prompt_len=3, pre=2)
    early.append(early[1].truncated(len(early), 2 + 2, mass=0.3))  # cut inside node 1's generated tokens
    chain = grow(rng, "chain", [(2, 3, [(3, 0, [])])], prompt_len=5)
    flat = grow(rng, "flat", [(2, 1, [(2, 0, [])]), (3, 0, []), (1, 0, [])], prompt_len=2)
    return [deep, early, chain, flat]


def leaf_advantages(rng: np.random.Generator, trees: list[list[Row]]) -> list[list[np.ndarray]]:
    """Per leaf token ``w_leaf · A(node)``, A random of both signs per tree node; 0 where the mask is 0."""
    out = []
    for rows in trees:
        credit = rng.normal(size=max(int(r.node.max()) for r in rows) + 1)
        out.append([r.tokens.meta.leaf_mass * np.where(r.node >= 0, credit[r.node], 0.0) * r.mask for r in rows])
    return out


# ---------------------------------------------------------------------------------------------------------------
# The two layouts as verl's workers hold them: per-row jagged tensors and the call's settings.


@dataclasses.dataclass(frozen=True)
class Layout:
    """verl's engine settings for one run; ``leaf_micro`` and ``packed_micro`` are the fixed micro-batch row
    counts, ``packed_tokens`` (if set) the packed rows' dynamic batch size instead."""

    remove_padding: bool
    pad_to_length: bool = False
    leaf_micro: int = 7
    packed_micro: int = 2
    packed_tokens: int | None = None


LAYOUTS = {
    "padded": Layout(remove_padding=False),
    "remove_padding": Layout(remove_padding=True, leaf_micro=2),
    "static_pad": Layout(remove_padding=True, pad_to_length=True),
    "dynamic_bsz": Layout(remove_padding=True, packed_tokens=64),
}


def batch(rows: list[dict[str, torch.Tensor]], info: dict) -> TensorDict:
    names = rows[0].keys()
    dtypes = {n: torch.float32 if rows[0][n].is_floating_point() else torch.int64 for n in names}
    return tu.get_tensordict({n: nested([r[n] for r in rows], dtypes[n]) for n in names}, info)


def settings(layout: Layout, packed: bool, train: bool, global_batch_size: int) -> dict:
    out = {"use_remove_padding": layout.remove_padding, "use_fused_kernels": False, "temperature": TEMPERATURE,
           "calculate_entropy": not train, "compute_loss": train}
    if packed and layout.packed_tokens:
        out.update(use_dynamic_bsz=True, max_token_len_per_gpu=layout.packed_tokens)
    else:
        out.update(use_dynamic_bsz=False,
                   micro_batch_size_per_gpu=layout.packed_micro if packed else layout.leaf_micro)
    if train:
        out["global_batch_size"] = global_batch_size
    return out


def leaf_batch(trees: list[list[Row]], layout: Layout, train: bool = False, old=None, adv=None) -> TensorDict:
    rows = []
    for t, tree_rows in enumerate(trees):
        for i, r in enumerate(tree_rows):
            ids = np.concatenate([r.tokens.prompt, r.tokens.response])
            row = {"prompts": torch.as_tensor(r.tokens.prompt), "responses": torch.as_tensor(r.tokens.response),
                   "input_ids": torch.as_tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.int64),
                   "position_ids": torch.arange(len(ids)), "response_mask": torch.as_tensor(r.mask),
                   "loss_mask": torch.as_tensor(r.mask)}
            if train:
                row.update(old_log_probs=torch.as_tensor(old[t][i]).float(),
                           advantages=torch.as_tensor(adv[t][i]).float())
            rows.append(row)
    return batch(rows, settings(layout, packed=False, train=train, global_batch_size=len(rows)))


def packed_batch(trees: list[list[Row]], packs: list[PackedTree], layout: Layout, train: bool = False, old=None,
                 adv=None) -> TensorDict:
    rows = []
    for t, (tree_rows, tree) in enumerate(zip(trees, packs)):
        row = packed_fields(tree, response_mask=packed_mask(tree, [r.mask for r in tree_rows]), rollout_log_probs=None)
        if train:
            row.update(old_log_probs=torch.as_tensor(old[t]).float(), advantages=torch.as_tensor(adv[t]).float())
        rows.append(row)
    return batch(rows, settings(layout, packed=True, train=train, global_batch_size=len(rows)))


# ---------------------------------------------------------------------------------------------------------------
# Running verl's engine.


def response_values(engine: FSDPEngineWithLMHead, data, forward=None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row, the response tokens' log-probs and entropies of a forward-only pass (verl's old log-probs)."""
    engine.module.eval()
    forward = forward or engine.forward_backward_batch
    with torch.no_grad():
        out = forward(data, None, forward_only=True)["model_output"]
    return tuple([t.numpy() for t in response_from_nested(out[k], data["response_mask"]).unbind()]
                 for k in ("log_probs", "entropy"))


def train_step(engine: FSDPEngineWithLMHead, data) -> dict[str, torch.Tensor]:
    """The parameter gradients of one training ``forward_backward_batch`` with verl's PPO loss."""
    config = FSDPActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=2, loss_agg_mode="seq-mean-token-sum",
                             clip_ratio=0.2)
    engine.module.train()
    engine.module.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data, functools.partial(ppo_loss, config=config), forward_only=False)
    assert all(np.isfinite(loss) for loss in out["loss"])
    return {name: p.grad.detach().clone() for name, p in engine.module.named_parameters() if p.grad is not None}


def lens(trees: list[list[Row]]) -> list[list[int]]:
    return [[len(r.tokens.response) for r in rows] for rows in trees]


def by_tree(values: list[np.ndarray], trees: list[list[Row]]) -> list[list[np.ndarray]]:
    """Per tree, its rows' values (the leaf batch lists the trees' rows one tree after another)."""
    it = iter(values)
    return [[next(it) for _ in rows] for rows in trees]


def max_gap(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> float:
    return max(float(np.abs(x - y).max()) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.mark.parametrize("name", LAYOUTS)
def test_log_probs_match_the_leaf_rows(name: str) -> None:
    layout = LAYOUTS[name]
    trees = forest()
    packs = [pack_tree([r.tokens for r in rows]) for rows in trees]
    engine = make_engine(tiny_qwen2(), layout.pad_to_length)

    leaf_lp, leaf_ent = (by_tree(v, trees) for v in response_values(engine, leaf_batch(trees, layout)))
    packed = packed_batch(trees, packs, layout)
    packed_lp, packed_ent = response_values(engine, packed)
    for values, leaf in ((packed_lp, leaf_lp), (packed_ent, leaf_ent)):
        mapped = [tree.to_leaves(v, n) for tree, v, n in zip(packs, values, lens(trees))]
        assert max_gap(mapped, leaf) <= 1e-5

    # the same packed rows under verl's plain causal attention: far off, so the tree attention is what matched
    plain, _ = response_values(engine, packed, functools.partial(FSDPEngineWithLMHead.forward_backward_batch, engine))
    mapped = [tree.to_leaves(v, n) for tree, v, n in zip(packs, plain, lens(trees))]
    assert max_gap(mapped, leaf_lp) > 1e-2


def check_gradients(layout: Layout, clipped: bool, checkpointing: bool = False) -> None:
    trees = forest()
    packs = [pack_tree([r.tokens for r in rows]) for rows in trees]
    engine = make_engine(tiny_qwen2(), layout.pad_to_length)
    rng = np.random.default_rng(1)

    # old log-probs: computed on the packed rows, each leaf token reads its packed copy's (as the BPO trainer does)
    old, _ = response_values(engine, packed_batch(trees, packs, layout))
    if clipped:  # the same noise on every copy of a token, so that PPO clips some tokens (ratio outside 1 ± 0.2)
        noise = [rng.normal(scale=0.4, size=len(v)).astype(np.float32) for v in old]
        ratio = np.exp(-np.concatenate(noise))
        assert (ratio < 0.8).any() and (ratio > 1.2).any()
        old = [v + n for v, n in zip(old, noise)]
    leaf_old = [tree.to_leaves(v, n) for tree, v, n in zip(packs, old, lens(trees))]
    leaf_adv = leaf_advantages(rng, trees)
    leaf_rows, packed_rows = sum(len(rows) for rows in trees), len(trees)
    adv = [packed_advantages(tree, a, scale=packed_rows / leaf_rows) for tree, a in zip(packs, leaf_adv)]

    leaf_grads = train_step(engine, leaf_batch(trees, layout, train=True, old=leaf_old, adv=leaf_adv))
    if checkpointing:
        engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packed_grads = train_step(engine, packed_batch(trees, packs, layout, train=True, old=old, adv=adv))

    compared = 0
    for name, g in leaf_grads.items():
        if not g.any():
            continue
        assert float((packed_grads[name] - g).norm() / g.norm()) <= 1e-5, name
        compared += 1
    assert compared > len(leaf_grads) // 2  # most tensors have a gradient: the check is not vacuous


@pytest.mark.parametrize("clipped", [False, True], ids=["ratio_1", "clipped"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_gradients_match_the_leaf_rows(name: str, clipped: bool) -> None:
    check_gradients(LAYOUTS[name], clipped)


def test_gradient_checkpointing_recomputes_under_the_plan() -> None:
    check_gradients(LAYOUTS["padded"], clipped=True, checkpointing=True)
