"""verl agent loop ``bpo_tree``: the sessions of one uid share one TreeSampler; each returns one leaf.

verl 0.9.1's v1 trainer runs ``rollout.n`` sessions per prompt uid as asyncio tasks in one AgentLoopWorker
process (``agent_loop_tq.py``: ``_run_prompt``), each calling ``run(sampling_params, session_id=i, uid=...)``.
Session 0's arrival creates the uid's tree; every session awaits it and returns leaf ``session_id`` as an ordinary
``AgentLoopOutput``: prompt + all turns, environment tokens with ``response_mask = 0``, rollout log-probs,
``reward_score`` = the leaf return, and the tree metadata in ``extra_fields["bpo"]`` (plus the tree's metrics in
``extra_fields["bpo_tree_metrics"]`` on leaf 0). The entry is dropped when the last session has collected.

The number of sessions is counted, not configured: every session of a uid registers before the tree starts
(``_run_prompt`` creates all n tasks before any runs), so validation (``val_kwargs.n``, often 1) gets plain
independent episodes and training gets the configured tree. A tree whose budget is turns or tokens may grow more
leaves than ``rollout.n``: the BPO trainer then runs ``bpo.max_leaves`` sessions per task (verl's
``__rollout_n__``), the tree's N stays ``rollout.n`` (the flat rollouts whose cost it matches), it grows at most
one leaf per session, and the sessions left over return no output. The sandbox and its task come from the dataset row:
``extra_info.sandbox`` (``{"name": ..., "config": {...}}`` or its JSON, default ``bpo.sandbox``) and
``extra_info.task`` (a mapping or its JSON); ``verl_bpo.data`` writes such rows.

The fork policy is per worker process: one :class:`~verl_bpo.core.fork_policy.ForkPolicy` per sandbox and tree
setting, shared by every tree the worker grows, in every training step, so what it learns from finished trees
(the ``quantile`` threshold, the learned depth profile) carries over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from sandbox_adapters.registry import make_sandbox
from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.core.leaf_meta import META_KEY
from verl_bpo.rollout.protocols import ChatCodec, Transcript
from verl_bpo.rollout.sampler import TreeSampler
from verl_bpo.rollout.tree_state import Leaf, TreeResult

__all__ = ["AGENT_NAME", "TREE_METRICS_KEY", "BPOTreeAgentLoop", "VerlChatCodec"]

logger = logging.getLogger(__name__)

AGENT_NAME = "bpo_tree"
TREE_METRICS_KEY = "bpo_tree_metrics"


class VerlChatCodec:
    """verl's continuous-token builder behind the sampler's ChatCodec protocol (masks and log-probs aligned)."""

    def __init__(self, agent_loop: AgentLoopBase) -> None:
        self.agent_loop = agent_loop

    async def start(self, messages: list[dict[str, str]]) -> list[int]:
        return await self.agent_loop.ct_build_initial_tokens(messages)

    async def add_assistant(self, transcript: Transcript, token_ids: list[int], log_probs: list[float]) -> str:
        merge, mask, logprobs = await self.agent_loop.ct_merge_assistant_token(
            transcript.token_ids, token_ids, transcript.response_mask, transcript.response_logprobs,
            assistant_logprobs=log_probs,
        )
        transcript.token_ids, transcript.response_mask, transcript.response_logprobs = merge.token_ids, mask, logprobs
        text = self.agent_loop.tokenizer.decode(token_ids, skip_special_tokens=True)
        transcript.messages.append({"role": "assistant", "content": text})
        return text

    async def add_user(self, transcript: Transcript, text: str) -> None:
        previous = list(transcript.messages)
        transcript.messages.append({"role": "user", "content": text})
        merge, mask, logprobs = await self.agent_loop.ct_merge_context_msg(
            previous, transcript.messages, transcript.token_ids, transcript.response_mask,
            transcript.response_logprobs,
        )
        transcript.token_ids, transcript.response_mask, transcript.response_logprobs = merge.token_ids, mask, logprobs


@dataclasses.dataclass
class _TreeEntry:
    sessions: set[int] = dataclasses.field(default_factory=set)
    collected: int = 0
    task: asyncio.Task | None = None


@register(AGENT_NAME)
class BPOTreeAgentLoop(AgentLoopBase):
    """One session of a BPO tree (see the module docstring)."""

    # Per worker process: the sessions of one uid all run in the same process and event loop.
    _trees: ClassVar[dict[str, _TreeEntry]] = {}
    _policies: ClassVar[dict[str, ForkPolicy]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs.pop("tools", None)
        super().__init__(*args, **kwargs)

    def make_codec(self) -> ChatCodec:
        """The tokenization of a tree's transcripts: verl's continuous-token builder."""
        return VerlChatCodec(self)

    @classmethod
    def fork_policy(cls, sandbox: str, config: BPOConfig) -> ForkPolicy:
        """This worker's policy for trees of ``sandbox`` under ``config`` (created on first use, then kept)."""
        key = json.dumps([sandbox, config.to_dict()], sort_keys=True, default=str)
        policy = cls._policies.get(key)
        if policy is None:
            policy = cls._policies[key] = ForkPolicy(config)
        return policy

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list:
        uid, session = str(kwargs["uid"]), int(kwargs.get("session_id", 0))
        entry = self._trees.get(uid)
        if entry is None:
            entry = self._trees[uid] = _TreeEntry()
            entry.task = asyncio.ensure_future(self._grow(entry, uid, sampling_params, kwargs))
        entry.sessions.add(session)
        try:
            result: TreeResult = await asyncio.shield(entry.task)
        finally:
            entry.collected += 1
            if entry.collected >= len(entry.sessions) and entry.task.done():
                self._trees.pop(uid, None)
        if session >= len(result.leaves):
            return []  # fewer leaves than sessions (the budget could not be spent): this session has none
        return self._output(result.leaves[session], result.metrics if session == 0 else None, result.weight_versions)

    async def _grow(self, entry: _TreeEntry, uid: str, sampling_params: dict[str, Any], row: Mapping) -> TreeResult:
        for _ in range(3):  # let every session of this uid register (they were all created before any ran)
            await asyncio.sleep(0)
        bpo = BPOConfig.from_mapping(_python(self.config.get("bpo") or {}))
        config = bpo.for_estimator(self.config.algorithm.adv_estimator)
        sessions = len(entry.sessions)
        n_leaves = min(self.rollout_config.n, sessions)
        if sessions > n_leaves:  # a turn- or token-budget tree: one session per leaf it may grow
            config = dataclasses.replace(config, max_leaves=sessions)
        extra = dict(row.get("extra_info") or {})
        sandbox_spec = _plain(extra.get("sandbox") or dataclasses.asdict(bpo.sandbox))
        name, sandbox_config = sandbox_spec["name"], sandbox_spec.get("config") or {}
        task = _plain(extra.get("task") or {})
        if not isinstance(task, Mapping):
            raise ValueError(f"extra_info.task of uid {uid} must be a mapping (or its JSON), got {type(task).__name__}")
        sampler = TreeSampler(
            config, n_leaves, self.rollout_config.response_length,
            lambda: make_sandbox(name, sandbox_config), task, self.server_manager, self.make_codec(),
            # str hash() is salted per process; crc32 makes the sandbox seeds a pure function of the uid.
            tree_id=uid, sampling_params=sampling_params, policy=self.fork_policy(name, config),
            seed=zlib.crc32(f"{uid}/{row.get('index', 0)}".encode()),
        )
        return await sampler.run()

    def _output(self, leaf: Leaf, tree_metrics: dict[str, float] | None,
                weight_versions: dict[str, int]) -> AgentLoopOutput:
        transcript, length = leaf.transcript, self.rollout_config.response_length
        extra_fields: dict[str, Any] = {
            **weight_versions,  # verl tags each row with the model versions that generated it
            META_KEY: leaf.meta.to_dict(),
            "bpo_leaf": {"failed": leaf.failed, "truncated": leaf.truncated, "won": leaf.won, "error": leaf.error},
        }
        if tree_metrics is not None:
            extra_fields[TREE_METRICS_KEY] = tree_metrics
        return AgentLoopOutput(
            prompt_ids=transcript.token_ids[: transcript.prompt_length],
            response_ids=transcript.response_ids[:length],
            response_mask=transcript.response_mask[:length],
            response_logprobs=transcript.response_logprobs[:length],
            reward_score=leaf.reward,
            num_turns=1 + 2 * leaf.meta.num_turns,
            metrics=AgentLoopMetrics(),
            extra_fields=extra_fields,
        )


def _plain(value: Any) -> Any:
    """A dataset or config value as plain Python: a JSON string (verl_bpo.data writes them), an OmegaConf
    container, or a mapping holding numpy values."""
    if isinstance(value, str):
        return json.loads(value)
    return _python(value)


def _python(value: Any) -> Any:
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _python(v) for k, v in value.items()}
    return value
