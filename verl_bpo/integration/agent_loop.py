"""verl agent loop ``bpo_tree``: the sessions of one uid share one TreeSampler; each returns one leaf.

verl 0.9.1's v1 trainer runs ``n`` sessions per prompt uid as asyncio tasks in one AgentLoopWorker process
(``agent_loop_tq.py``: ``_run_prompt``), each calling ``run(sampling_params, session_id=i, uid=...)``.

**Training.** The BPO trainer hands every training row the run's one learned allocation state (``STATE_KEY``: the
fork policy's state for the step's tasks, and the sessions it asked verl to run per task; see
:class:`~verl_bpo.integration.trainer.BPOTrainer`). The first session of a uid to arrive starts the uid's tree
from that state; every session, whenever it arrives, awaits the same tree and returns leaf ``session_id`` as an
ordinary ``AgentLoopOutput``: prompt + all turns, environment tokens with ``response_mask = 0``, rollout
log-probs, ``reward_score`` = the leaf return, and the tree metadata in ``extra_fields["bpo"]`` (plus, on leaf 0,
the tree's metrics in ``extra_fields["bpo_tree_metrics"]``, its record for the run's fork policy in
``extra_fields["bpo_tree_record"]``, and the row's task in ``extra_fields["bpo_tree_task"]``). The entry is dropped
when the last session has collected. A tree whose budget is turns or tokens may grow more leaves than
``rollout.n``: the trainer then runs ``bpo.learned.max_leaves`` sessions per task (verl's ``__rollout_n__``), the
tree's N stays ``rollout.n`` (the flat rollouts whose cost it matches), it grows at most one leaf per session, and
the sessions left over return no output. Workers never learn: every tree plans on the state the trainer handed out, so
every worker of a step plans on the same profile.

**Validation** (a row without ``STATE_KEY``: verl's ``_validate`` submits its rows directly): each session plays one
independent episode, exactly as a GRPO run validates, and nothing it does reaches the learned state.

The sandbox and its task come from the dataset row: ``extra_info.sandbox`` (``{"name": ..., "config": {...}}`` or its
JSON, default ``bpo.sandbox``) and ``extra_info.task`` (a mapping or its JSON); ``verl_bpo.data`` writes such rows.
A training row may also carry ``extra_info.bpo_budget``: the tree's root budget in ``bpo.learned.budget_unit`` under
``bpo.allocation=learned`` (e.g. the tokens a baseline's group generated on the task, for a comparison at matched
compute), used instead of the learned one; flat groups and validation episodes ignore it. Trees that used it log
``bpo/budget_from_row`` = 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import numbers
import zlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from sandbox_adapters.base import Sandbox
from sandbox_adapters.registry import SandboxRuntimeMissing, check_runtime, make_sandbox
from verl_bpo.core.config import BPOConfig, Mode
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.core.leaf_meta import META_KEY
from verl_bpo.rollout.protocols import ChatCodec, Transcript
from verl_bpo.rollout.sampler import TreeSampler
from verl_bpo.rollout.tree_state import Leaf, TreeResult

__all__ = ["AGENT_NAME", "TREE_METRICS_KEY", "TREE_RECORD_KEY", "TREE_TASK_KEY", "STATE_KEY", "BUDGET_FIELD",
           "BPOTreeAgentLoop", "VerlChatCodec", "row_task", "row_budget", "task_key"]

logger = logging.getLogger(__name__)

AGENT_NAME = "bpo_tree"
TREE_METRICS_KEY = "bpo_tree_metrics"
TREE_RECORD_KEY = "bpo_tree_record"
TREE_TASK_KEY = "bpo_tree_task"  # leaf 0's extra field: the row's task (for the trainer's tree log)
BUDGET_FIELD = "bpo_budget"  # a row's extra_info field: its tree's root budget, in bpo.learned.budget_unit
STATE_KEY = "bpo_allocation_state"  # the training row's column: JSON of {"policy": ..., "sessions": ...}

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
class RowTask:
    """The sandbox and task of one dataset row."""

    sandbox: str
    sandbox_config: dict[str, Any]
    task: dict[str, Any]
    budget: float | None = None  # extra_info.bpo_budget: the tree's root budget (learned allocation), if given

    @property
    def key(self) -> str:
        return task_key(self.sandbox, self.sandbox_config, self.task)


def row_task(extra_info: Mapping[str, Any] | None, default_sandbox: Mapping[str, Any], uid: str = "?") -> RowTask:
    """A row's ``extra_info.sandbox`` (else ``default_sandbox``, i.e. ``bpo.sandbox``) and ``extra_info.task``."""
    extra = dict(extra_info or {})
    spec = _plain(extra.get("sandbox") or default_sandbox)
    task = _plain(extra.get("task") or {})
    if not isinstance(task, Mapping):
        raise ValueError(f"extra_info.task of uid {uid} must be a mapping (or its JSON), got {type(task).__name__}")
    return RowTask(spec["name"], dict(spec.get("config") or {}), dict(task), row_budget(extra, uid))


def row_budget(extra_info: Mapping[str, Any] | None, uid: str = "?") -> float | None:
    """A row's ``extra_info.bpo_budget`` as a float, ``None`` when absent (or null: a parquet file whose other rows
    carry one). Anything but a positive finite number is an error naming the field."""
    value = _python((extra_info or {}).get(BUDGET_FIELD))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"extra_info.{BUDGET_FIELD} of uid {uid} must be a positive number (the tree's budget in "
                         f"bpo.learned.budget_unit: turns, tokens or leaves), got {value!r}")
    return float(value)


def task_key(sandbox: str, sandbox_config: Mapping[str, Any], task: Mapping[str, Any]) -> str:
    """A stable name of a task (the same in every process and run): what its per-task episode cost is kept under."""
    text = json.dumps([sandbox, sandbox_config, task], sort_keys=True, default=str)
    return f"{sandbox}:{zlib.crc32(text.encode()):08x}"


@register(AGENT_NAME)
class BPOTreeAgentLoop(AgentLoopBase):
    """One session of a BPO tree, or one validation episode (see the module docstring)."""

    # Per worker process: the sessions of one uid all run in the same process and event loop.
    _trees: ClassVar[dict[str, asyncio.Task]] = {}
    _collected: ClassVar[dict[str, int]] = {}
    _runtime_ok: ClassVar[set[str]] = set()  # sandbox settings whose runtime this process found

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs.pop("tools", None)
        super().__init__(*args, **kwargs)

    def make_codec(self) -> ChatCodec:
        """The tokenization of a tree's transcripts: verl's continuous-token builder."""
        return VerlChatCodec(self)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list:
        uid, session = str(kwargs["uid"]), int(kwargs.get("session_id", 0))
        state = kwargs.get(STATE_KEY)
        if state is None:  # validation: one independent episode per session
            result = await self._grow(f"{uid}/{session}", sampling_params, kwargs, None)
            return self._output(result.leaves[0], result.metrics, result.weight_versions, None)
        state = json.loads(state) if isinstance(state, str) else _python(state)
        sessions = int(state["sessions"])
        tree = self._trees.get(uid)
        if tree is None:  # the first session to arrive starts the tree; the others, whenever they come, await it
            tree = self._trees[uid] = asyncio.ensure_future(self._grow(uid, sampling_params, kwargs, state))
            self._collected[uid] = 0
        try:
            result: TreeResult = await asyncio.shield(tree)
        finally:
            self._collected[uid] = self._collected.get(uid, 0) + 1
            if self._collected[uid] >= sessions:
                self._trees.pop(uid, None)
                self._collected.pop(uid, None)
        if session >= len(result.leaves):
            return []  # fewer leaves than sessions (the budget could not be spent): this session has none
        first = session == 0
        return self._output(result.leaves[session], result.metrics if first else None, result.weight_versions,
                            result.record.to_dict() if first and result.record is not None else None,
                            self._row_task(kwargs, uid).task if first else None)

    @classmethod
    async def _sandbox_factory(cls, where: RowTask) -> Callable[[], Sandbox]:
        """Fresh sandboxes of the row's kind. Where the sandbox's runtime (Docker, bwrap) is missing on this node,
        every call raises the error naming the node: the tree becomes failed leaves, and the trainer stops the run
        when most trees of a step never start. The check runs off the event loop (``docker info`` can take seconds)
        and a passed check is remembered per process and sandbox setting."""
        key = json.dumps([where.sandbox, where.sandbox_config], sort_keys=True, default=str)
        if key not in cls._runtime_ok:
            try:
                await asyncio.to_thread(check_runtime, where.sandbox, where.sandbox_config)
                cls._runtime_ok.add(key)
            except SandboxRuntimeMissing as exc:
                message = str(exc)

                def unavailable() -> Sandbox:
                    raise SandboxRuntimeMissing(message)  # a fresh error each time: no traceback chain kept alive
                return unavailable
        return lambda: make_sandbox(where.sandbox, where.sandbox_config)

    async def _grow(self, tree_id: str, sampling_params: dict[str, Any], row: Mapping,
                    state: Mapping[str, Any] | None) -> TreeResult:
        """The uid's tree (``state``: the trainer's) or, without state, one independent episode."""
        bpo = BPOConfig.from_mapping(_python(self.config.get("bpo") or {}))
        config = bpo.for_estimator(self.config.algorithm.adv_estimator)
        where = self._row_task(row, tree_id)
        policy = None
        if state is None:
            config, rollout_n = dataclasses.replace(config, mode=Mode.flat), 1
        else:
            sessions = int(state["sessions"])
            rollout_n = min(self.rollout_config.n, sessions)
            if sessions > rollout_n:  # a turn- or token-budget tree: one session per leaf it may grow
                config = dataclasses.replace(config, learned=dataclasses.replace(config.learned, max_leaves=sessions))
            policy = ForkPolicy(config)
            policy.load_state_dict(state["policy"])
        budget = where.budget if state is not None else None  # a training tree's budget from its row, if any
        deterministic = bool(self.rollout_config.get("full_determinism", False))
        sampler = TreeSampler(
            config, rollout_n, self.rollout_config.response_length, await self._sandbox_factory(where), where.task,
            self.server_manager,
            self.make_codec(), tree_id=tree_id, sampling_params=sampling_params, policy=policy,
            # str hash() is salted per process; crc32 makes the sandbox seeds a pure function of the uid.
            seed=zlib.crc32(f"{tree_id}/{row.get('index', 0)}".encode()), root_budget=budget, task_key=where.key,
            unique_request_ids=deterministic,
            # vLLM takes a per-request seed in its SamplingParams (SGLang names it otherwise): a turn's sample then
            # depends on its branch, not on which requests the engine batched it with.
            seeded_turns=deterministic and self.rollout_config.get("name") == "vllm",
        )
        result = await sampler.run()
        if "bpo/budget" in result.metrics:  # a budgeted (learned) plan: did its budget come from the row?
            result.metrics["bpo/budget_from_row"] = float(budget is not None)
        return result

    def _row_task(self, row: Mapping, tree_id: str) -> RowTask:
        """The row's sandbox, task and budget (``bpo.sandbox`` where the row names no sandbox)."""
        bpo = BPOConfig.from_mapping(_python(self.config.get("bpo") or {}))
        return row_task(row.get("extra_info"), dataclasses.asdict(bpo.sandbox), tree_id)

    def _output(self, leaf: Leaf, tree_metrics: dict[str, float] | None, weight_versions: dict[str, int],
                record: dict[str, Any] | None, task: dict[str, Any] | None = None) -> AgentLoopOutput:
        transcript, length = leaf.transcript, self.rollout_config.response_length
        extra_fields: dict[str, Any] = {
            **weight_versions,  # verl tags each row with the model versions that generated it
            META_KEY: leaf.meta.to_dict(),
            "bpo_leaf": {"failed": leaf.failed, "truncated": leaf.truncated, "won": leaf.won, "error": leaf.error},
        }
        if tree_metrics is not None:
            extra_fields[TREE_METRICS_KEY] = tree_metrics
        if record is not None:
            extra_fields[TREE_RECORD_KEY] = record
        if task is not None:
            extra_fields[TREE_TASK_KEY] = task
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
