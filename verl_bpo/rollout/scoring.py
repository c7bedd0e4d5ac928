"""Fork scores: how much a node is worth forking, read from the node's frozen view (and, for S2, a probe).

    parent_turn_surprisal (S3)  mean −log π of the turn that led to the node: free, from the rollout log-probs.
    probe_surprisal (S2)        mean −log π of a short continuation sampled from the node and thrown away
                                (ARPO's "entropy after a tool call", arXiv:2507.19849); costs ``bpo.fixed.probe_tokens``.
    next_token_entropy (S1)     entropy of the node's next-token distribution; needs a client that returns it.
    kept_turn_surprisal (S4)    mean −log π of the node's own kept turn, drawn before deciding: anticipating, so
                                biased (the posthoc fork of ARPO and TreeRL, arXiv:2506.11902). An ablation
                                (``bpo.ablation.kept_turn_surprisal``), which replaces ``bpo.fixed.score``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import NodeView
from verl_bpo.rollout.protocols import LLMClient
from verl_bpo.rollout.tree_state import Branch, TreeState

__all__ = ["ForkScorer", "mean_surprisal"]


def mean_surprisal(log_probs: Sequence[float]) -> float:
    return -sum(log_probs) / len(log_probs) if log_probs else 0.0


class ForkScorer:
    """Scores the candidates of one tree (``request_id`` gives each probe the tree's request id, so probes share
    the tree's prefix cache)."""

    def __init__(self, config: BPOConfig, llm: LLMClient, request_id: Callable[[], str],
                 params: Callable[[Branch, str, int], dict[str, Any]], tree: TreeState) -> None:
        if config.fixed.score == "next_token_entropy" and not hasattr(llm, "next_token_entropy"):
            raise ValueError(
                "bpo.fixed.score=next_token_entropy needs an LLM client that returns the full next-token "
                "distribution; verl's vLLM/SGLang servers return only sampled-token log-probs. Use "
                "bpo.fixed.score=probe_surprisal or parent_turn_surprisal."
            )
        self.config, self.llm, self.request_id = config, llm, request_id
        self.params = params  # a probe's sampling parameters: (branch, purpose, max_tokens) -> parameters
        self.tree = tree  # probes are generated tokens too: rollout compute the tree spent

    async def __call__(self, branch: Branch, view: NodeView) -> float:
        if self.config.anticipating:
            return mean_surprisal(branch.pending[1])
        score = self.config.fixed.score
        if score == "parent_turn_surprisal":
            return float(view.parent_turn_surprisal or 0.0)
        if score == "probe_surprisal":
            params = self.params(branch, "probe", self.config.fixed.probe_tokens)
            out = await self.llm.generate(self.request_id(), prompt_ids=list(view.history), sampling_params=params)
            self.tree.generated_tokens += len(out.token_ids)
            return mean_surprisal(out.log_probs or [])
        return float(await self.llm.next_token_entropy(list(view.history)))
