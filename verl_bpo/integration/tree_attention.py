"""Attention over packed trees: each token sees its own segment's earlier keys and every key of its ancestors.

A packed tree (:mod:`verl_bpo.core.packing`) holds each unique token once, so one causal mask over the row is
wrong: a later sibling must not see the earlier siblings laid out before it. Over one flat index space of N
positions (``b * T + t`` for a batch of B rows of T), position i in segment s attends position j iff

    is_key[j]  and  (segment[j] is a strict ancestor of s  or  (segment[j] == s and j <= i))

and padding (``segment == -1``) attends nothing, is never attended and outputs 0. Bridges are query-only tokens
alone in their segment, so they see exactly their ancestors' keys.

A dense N×N mask would pay for every sibling pair the rule forbids. :class:`TreeAttentionPlan` instead cuts each
segment's queries into *blocks* of at most ``block`` consecutive queries; a block's keys are its ancestors' keys
(all visible) then its own segment's keys up to its last query (visible causally). A block pays
``queries × keys`` pairs, at most ``block - 1`` per query more than the rule's pairs, and never more than the
same queries pay in a dense root-to-leaf row. Blocks are batched into a few groups, padded to the group's largest block,
so that each layer makes a handful of ``scaled_dot_product_attention`` calls: blocks are taken by decreasing key
count and each joins the first group it keeps within ``slack`` × the group's unpadded pairs. Hence

    padded_pairs <= slack · (exact_pairs + n_queries · (block - 1) / 2).

:func:`install` hooks transformers' registered attention functions (``sdpa`` and flash attention): while a plan
is active (:func:`packed_trees`) they run :func:`tree_attention_forward` and ignore the model's own mask;
otherwise they run the original unchanged. ``eager`` attention is called directly by the models, not through the
registry, so packing cannot hook it (:func:`check_supported`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator

import numpy as np
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

__all__ = [
    "HOOKED_IMPLEMENTATIONS",
    "TreeAttentionPlan",
    "check_supported",
    "install",
    "plan_slot",
    "packed_trees",
    "tree_attention_forward",
]

# Registry names whose functions share the (module, query, key, value, attention_mask, dropout, scaling, ...) call.
HOOKED_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")

_ACTIVE: contextvars.ContextVar[TreeAttentionPlan | None] = contextvars.ContextVar(
    "verl_bpo_tree_attention_plan", default=None)
_WRAPPED = "_verl_bpo_tree_attention"  # marks our wrappers, so that install() never wraps one twice


@dataclasses.dataclass(frozen=True)
class _Group:
    """Blocks padded to one shape: ``(G, Q)`` query and ``(G, K)`` key positions, the ``(G, Q, K)`` visibility
    mask, and which of the ``G · Q`` query slots are real (the rest are padding, dropped)."""

    query_index: torch.Tensor
    key_index: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Block:
    queries: np.ndarray
    keys: np.ndarray  # the ancestor keys, then the own segment's keys up to the last query
    ancestors: int  # how many of ``keys`` are ancestor keys (visible to every query)


@dataclasses.dataclass(frozen=True)
class TreeAttentionPlan:
    """The index tensors of the tree attention of one batch (module docstring), built once, used by every layer.

    Attributes:
        size: N, the flat positions (``B * T``) the plan covers.
        groups: the padded groups of blocks, one ``scaled_dot_product_attention`` call each.
        scatter_index: the flat position of each real query slot, in group order.
        exact_pairs: the (query, key) pairs the attention rule allows.
        padded_pairs: the pairs the groups compute, padding and masked-out pairs included.
    """

    size: int
    groups: tuple[_Group, ...]
    scatter_index: torch.Tensor
    exact_pairs: int
    padded_pairs: int

    @classmethod
    def build(cls, segment: torch.Tensor, parent: torch.Tensor, is_key: torch.Tensor,
              device: torch.device | str | None = None, block: int = 256, slack: float = 1.25) -> TreeAttentionPlan:
        """The plan for ``segment`` ``(N,)`` (each position's segment id, -1 on padding), ``parent`` ``(S,)``
        (each segment's parent, -1 for roots) and ``is_key`` ``(N,)``, on ``device`` (default: ``segment``'s)."""
        if block < 1 or slack < 1:
            raise ValueError(f"block must be >= 1 and slack >= 1, got block={block}, slack={slack}")
        seg, par, key = (t.detach().cpu().numpy() for t in (segment, parent, is_key))
        _validate(seg, par, key)
        blocks = _blocks(seg, par, key.astype(bool), block)
        groups = _group(blocks, slack)
        device = segment.device if device is None else torch.device(device)
        padded = [_pad(g) for g in groups]
        queries = [b.queries for g in groups for b in g]  # the order of the groups' kept query slots
        return cls(
            size=len(seg),
            groups=tuple(_Group(*(torch.from_numpy(a).to(device) for a in arrays)) for arrays in padded),
            scatter_index=torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *queries])).to(device),
            exact_pairs=int(sum(_visible(b).sum() for b in blocks)),
            padded_pairs=sum(q.size * k.shape[1] for q, k, _, _ in padded),
        )


def _validate(seg: np.ndarray, par: np.ndarray, key: np.ndarray) -> None:
    if seg.ndim != 1 or par.ndim != 1 or key.shape != seg.shape:
        raise ValueError(f"segment and is_key must be (N,) and parent (S,), got {seg.shape}, {key.shape}, {par.shape}")
    n_seg = len(par)
    if seg.size and (seg.min() < -1 or seg.max() >= n_seg):
        raise ValueError(f"segment ids must lie in [-1, {n_seg}), got [{seg.min()}, {seg.max()}]")
    bad = np.flatnonzero((par < -1) | (par >= np.arange(n_seg)))
    if bad.size:
        s = bad[0]
        raise ValueError(f"segment {s} has parent {par[s]}: a parent must be -1 or an earlier segment")
    real = seg >= 0
    run_start = real & np.r_[True, seg[1:] != seg[:-1]]
    runs = np.bincount(seg[run_start], minlength=n_seg)
    if (runs > 1).any():
        raise ValueError(f"segment {np.flatnonzero(runs > 1)[0]} is not contiguous: each segment must be one run")


def _blocks(seg: np.ndarray, par: np.ndarray, key: np.ndarray, block: int) -> list[_Block]:
    """Each segment's queries in blocks of at most ``block``; a query that sees no key at all is left out (its
    output stays 0), so no real query row is fully masked."""
    real = np.flatnonzero(seg >= 0)
    by_seg = real[np.argsort(seg[real], kind="stable")]  # segments are contiguous runs, so this keeps their order
    bounds = np.searchsorted(seg[by_seg], np.arange(len(par) + 1))
    path_keys: list[np.ndarray] = []  # the keys a segment's last token sees: its ancestors' then its own
    out = []
    for s in range(len(par)):
        positions = by_seg[bounds[s]:bounds[s + 1]]
        own = positions[key[positions]]
        ancestors = path_keys[par[s]] if par[s] >= 0 else np.zeros(0, np.int64)
        path_keys.append(np.concatenate([ancestors, own]))
        seen = len(ancestors) + np.searchsorted(own, positions, side="right")
        queries = positions[seen > 0]
        for start in range(0, len(queries), block):
            chunk = queries[start:start + block]
            mine = own[:np.searchsorted(own, chunk[-1], side="right")]
            out.append(_Block(chunk, np.concatenate([ancestors, mine]), len(ancestors)))
    return out


def _visible(b: _Block) -> np.ndarray:
    """``(q, k)`` which of a block's keys each of its queries sees."""
    own = b.keys[None, b.ancestors:] <= b.queries[:, None]
    return np.concatenate([np.ones((len(b.queries), b.ancestors), bool), own], axis=1)


def _group(blocks: list[_Block], slack: float) -> list[list[_Block]]:
    """First fit by decreasing key count: a block joins the first group whose padded pairs stay within ``slack``
    × its unpadded pairs, so the first block of a group sets its key count and the bound holds group by group."""
    groups: list[list[_Block]] = []
    stats: list[tuple[int, int, int]] = []  # per group: its largest query count, its key count, its unpadded pairs
    for b in sorted(blocks, key=lambda b: (-len(b.keys), -len(b.queries))):
        q, k = len(b.queries), len(b.keys)
        for i, (q_max, k_max, pairs) in enumerate(stats):
            q_new = max(q_max, q)
            if (len(groups[i]) + 1) * q_new * k_max <= slack * (pairs + q * k):
                groups[i].append(b)
                stats[i] = (q_new, k_max, pairs + q * k)
                break
        else:
            groups.append([b])
            stats.append((q, k, q * k))
    return groups


def _pad(group: list[_Block]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A group's index tensors; padded slots point at position 0 and are masked out, except that a padded query
    row sees its first key so that no softmax row is empty (its output is dropped)."""
    q_max = max(len(b.queries) for b in group)
    k_max = max(len(b.keys) for b in group)
    query_index = np.zeros((len(group), q_max), np.int64)
    key_index = np.zeros((len(group), k_max), np.int64)
    mask = np.zeros((len(group), q_max, k_max), bool)
    mask[:, :, 0] = True
    keep = []
    for g, b in enumerate(group):
        q, k = len(b.queries), len(b.keys)
        query_index[g, :q] = b.queries
        key_index[g, :k] = b.keys
        mask[g, :q, :k] = _visible(b)
        keep.append(g * q_max + np.arange(q))
    return query_index, key_index, mask, np.concatenate(keep)


def tree_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: TreeAttentionPlan,
                           scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Tree attention of ``query`` ``(B, H, T, D)`` over ``key``, ``value`` ``(B, Hkv, T, D)`` (H a multiple of
    Hkv), as ``(B, T, H, D)`` like transformers' attention functions return it, 0 on padding. ``scaling`` None is
    ``D ** -0.5``."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[2] != length or batch * length != plan.size:
        raise ValueError(f"the plan covers {plan.size} positions, but the attention got {batch} rows of "
                         f"{length} queries and {key.shape[2]} keys (no KV cache under a plan)")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
    if plan.scatter_index.device != query.device:
        raise ValueError(f"the plan is on {plan.scatter_index.device}, the attention on {query.device}: build the "
                         "plan with device=")
    q = query.transpose(1, 2).reshape(plan.size, heads, dim)
    k = key.transpose(1, 2).reshape(plan.size, kv_heads, dim)
    v = value.transpose(1, 2).reshape(plan.size, kv_heads, dim)
    parts = []
    for g in plan.groups:
        n_groups, q_len = g.query_index.shape
        out = torch.nn.functional.scaled_dot_product_attention(
            _gather(q, g.query_index), _gather(k, g.key_index), _gather(v, g.key_index), attn_mask=g.mask[:, None],
            dropout_p=dropout, scale=scaling, enable_gqa=heads != kv_heads)
        parts.append(out.transpose(1, 2).reshape(n_groups * q_len, heads, dim).index_select(0, g.keep))
    flat = q.new_zeros(plan.size, heads, dim)
    if parts:
        flat = flat.index_copy(0, plan.scatter_index, torch.cat(parts))
    return flat.view(batch, length, heads, dim)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``(G, heads, L, D)`` the rows ``index`` ``(G, L)`` of ``x`` ``(N, heads, D)``; ``index_select`` because its
    backward is a plain ``index_add``."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)


@contextlib.contextmanager
def packed_trees(plan: TreeAttentionPlan) -> Iterator[TreeAttentionPlan]:
    """Make ``plan`` the attention of every hooked attention call in this context (see :func:`install`)."""
    token = _ACTIVE.set(plan)
    try:
        yield plan
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def plan_slot() -> Iterator[Callable[[TreeAttentionPlan | None], object]]:
    """A scope whose yielded setter makes a plan active until the next call or the scope's end: for a caller that
    runs a micro-batch's backward (and the recomputation gradient checkpointing does in it) after the forward
    returned, as verl's engine does."""
    token = _ACTIVE.set(None)
    try:
        yield _ACTIVE.set
    finally:
        _ACTIVE.reset(token)


def _active_plan() -> TreeAttentionPlan | None:
    """The plan of this context, else that of the context which launched the running backward. Gradient
    checkpointing recomputes layers during backward, for GPU tensors on an autograd worker thread where this
    context's variables are unset; autograd hands such threads the launching context in its thread-local state
    (torch's compiled backward reads it from there the same way)."""
    plan = _ACTIVE.get()
    if plan is None and torch._C._is_key_in_tls("context"):
        launching = torch._C._get_obj_in_tls("context")
        plan = None if launching is None else launching.get(_ACTIVE)
    return plan


def _tree_aware(original: Callable) -> Callable:
    """``original``, except that under an active plan it runs the tree attention and ignores the model's mask."""

    @functools.wraps(original)
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args, **kwargs) -> tuple[torch.Tensor, None]:
        plan = _active_plan()
        if plan is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        named = {**dict(zip(("dropout", "scaling"), args)), **kwargs}
        unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if named.get(name) is not None]
        if unsupported:
            raise ValueError(f"packed trees do not support attention with {', '.join(unsupported)}")
        return tree_attention_forward(query, key, value, plan, named.get("scaling"), named.get("dropout", 0.0)), None

    setattr(attention, _WRAPPED, True)
    return attention


def _no_mask_under_plan(original: Callable) -> Callable:
    """``original`` mask builder, except that under an active plan it builds nothing: the plan is the attention's
    truth, and the model's (batch, 1, T, T) mask over a row as long as a whole tree (or, without padding, over a
    whole micro-batch) would cost more than the attention itself."""

    @functools.wraps(original)
    def mask(*args, **kwargs):
        return None if _active_plan() is not None else original(*args, **kwargs)

    setattr(mask, _WRAPPED, True)
    return mask


def install() -> None:
    """Hook the registered ``sdpa`` and flash attention functions and their mask builders (idempotent). The shared
    registry instance's own overrides (verl sets some) shadow the class-wide ones, so each name is set in both."""
    for registry, interface, wrap in ((ALL_ATTENTION_FUNCTIONS, AttentionInterface, _tree_aware),
                                      (ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, _no_mask_under_plan)):
        for name in HOOKED_IMPLEMENTATIONS:
            if name not in registry or getattr(registry[name], _WRAPPED, False):
                continue
            wrapped = wrap(registry[name])
            interface.register(name, wrapped)
            registry[name] = wrapped


def check_supported(attn_implementation: str) -> None:
    """Raise unless packed trees can hook ``attn_implementation``."""
    if attn_implementation not in HOOKED_IMPLEMENTATIONS:
        raise ValueError(
            f"actor_rollout_ref.model.override_config.attn_implementation={attn_implementation}: packed trees replace "
            f"the attention through transformers' attention registry, which {attn_implementation} attention does "
            "not go through; use sdpa or flash_attention_2")
