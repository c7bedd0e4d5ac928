"""The ``bpo:`` config block: every field, its default and its meaning (mirrored in ``config/bpo_trainer.yaml``).

Tree shape comes from verl's own ``actor_rollout_ref.rollout.n`` (N leaves per task); the rest lives here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from omegaconf import OmegaConf

from verl_bpo.branching import BranchingConfig
from verl_bpo.sampler import SamplerConfig

__all__ = ["BPOConfig", "SandboxSpec", "sampler_config_from", "TREE_ESTIMATORS"]

# Estimators that consume the tree; every other estimator gets flat groups under bpo.mode=auto.
TREE_ESTIMATORS = frozenset({"bpo"})


@dataclasses.dataclass
class SandboxSpec:
    """Which sandbox each task runs in (a dataset row's ``extra_info.sandbox`` overrides it).

    Attributes:
        name: registry name (``smoke``, ``textworld``, ``alfworld``, ``swebench``, ``webshop`` or your own).
        config: keys of that adapter's ``Config`` dataclass.
    """

    name: str = "smoke"
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BPOConfig:
    """Branching Policy Optimization settings (``bpo.<field>=...`` on the command line).

    Parameters that shape the tree:
        mode: ``"auto"`` (default): a tree when ``algorithm.adv_estimator=bpo``, flat groups (N independent
            rollouts through the same sampler) for every other estimator; ``"tree"`` or ``"flat"`` force one.
        k: children per fork below the root (K). Default 2.
        k0: children of the root fork (K0); ``null`` = ``k``. ``k0 = rollout.n`` is flat mode.
        score: fork score: ``parent_turn_surprisal`` (S3, default, free), ``probe_surprisal`` (S2, a discarded
            ``probe_tokens`` probe), ``next_token_entropy`` (S1, needs a client with full next-token distributions),
            ``kept_turn_surprisal`` (S4: biased ablation, never for real runs).
        selector: ``topB_wave`` (default; fills the leaf budget whenever the horizon allows) or ``quantile``.
        max_forks_per_wave: cap on forks per wave (``topB_wave``); ``null`` = none.
        min_depth: no fork before this many turns (default 1).
        max_forks_per_path: cap on forks along one path, the root fork excluded; ``null`` = none.
        cooldown: no fork within this many turns after a fork on the same path (default 0).

    Parameters that bound a path:
        max_turns: turns after which a path is cut (default 8).
        max_tokens_per_turn: cap on one turn's tokens; ``null`` = the rest of ``rollout.response_length``.
        probe_tokens: probe length for ``probe_surprisal`` (default 16).
        step_timeout_s: a sandbox step/restore slower than this fails its leaf (default 60).

    Parameters of the advantage (see ``verl_bpo.tree.CreditOptions``; ``gamma`` is ``algorithm.gamma``):
        baseline: ``loo`` (default, unbiased) or ``mean_incl_self``.
        scale: ``none`` (default) or ``group_std`` (biased).
        discount_weighting: ``segment`` (default) or ``exact``.
        epsilon: added to the std under ``group_std`` (default 1e-6).

    sandbox: the default :class:`SandboxSpec`.
    """

    mode: Literal["auto", "tree", "flat"] = "auto"
    k: int = 2
    k0: int | None = None
    score: str = "parent_turn_surprisal"
    selector: Literal["topB_wave", "quantile"] = "topB_wave"
    max_forks_per_wave: int | None = None
    min_depth: int = 1
    max_forks_per_path: int | None = None
    cooldown: int = 0
    max_turns: int = 8
    max_tokens_per_turn: int | None = None
    probe_tokens: int = 16
    step_timeout_s: float = 60.0
    baseline: str = "loo"
    scale: str = "none"
    discount_weighting: str = "segment"
    epsilon: float = 1e-6
    sandbox: SandboxSpec = dataclasses.field(default_factory=SandboxSpec)

    @classmethod
    def from_config(cls, cfg: Any) -> BPOConfig:
        """From the ``bpo`` DictConfig/dict; unknown keys are an error that lists the valid ones."""
        raw = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown bpo config key(s) {unknown}; valid keys: {sorted(known)}")
        if "sandbox" in raw:
            raw["sandbox"] = SandboxSpec(**(raw["sandbox"] or {}))
        if raw.get("mode", "auto") not in ("auto", "tree", "flat"):
            raise ValueError(f"bpo.mode={raw['mode']!r} is not valid; use auto, tree or flat")
        return cls(**raw)


def sampler_config_from(bpo_cfg: Any, n_leaves: int, estimator: str, response_length: int) -> SamplerConfig:
    """The TreeSampler settings for one uid with ``n_leaves`` sessions under ``algorithm.adv_estimator``."""
    cfg = bpo_cfg if isinstance(bpo_cfg, BPOConfig) else BPOConfig.from_config(bpo_cfg)
    flat = cfg.mode == "flat" or (cfg.mode == "auto" and estimator not in TREE_ESTIMATORS) or n_leaves < 2
    branching = BranchingConfig(
        n_leaves=n_leaves,
        k=cfg.k,
        k0=n_leaves if flat else (min(cfg.k, n_leaves) if cfg.k0 is None else cfg.k0),
        score=cfg.score,
        selector=cfg.selector,
        max_forks_per_wave=cfg.max_forks_per_wave,
        min_depth=cfg.min_depth,
        max_forks_per_path=cfg.max_forks_per_path,
        cooldown=cfg.cooldown,
    )
    return SamplerConfig(
        branching=branching,
        max_turns=cfg.max_turns,
        response_length=response_length,
        max_tokens_per_turn=cfg.max_tokens_per_turn,
        probe_tokens=cfg.probe_tokens,
        step_timeout_s=cfg.step_timeout_s,
    )


def as_mapping(cfg: Any) -> Mapping[str, Any]:
    return dataclasses.asdict(cfg) if isinstance(cfg, BPOConfig) else cfg
