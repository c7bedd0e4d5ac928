"""The `bpo_tree` agent loop inside verl's agent-loop API, without Ray or a GPU.

A real (tiny, locally trained) tokenizer and verl's continuous-token builder; the LLM server is a scripted fake that
returns real token ids. Sessions are launched the way verl's v1 worker does (all n tasks created before any runs).
"""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from tests.fakes import UnstartableSmoke
from verl_bpo.integration import agent_loop
from verl_bpo.core.config import BPOConfig
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.integration.agent_loop import STATE_KEY, TREE_METRICS_KEY, TREE_RECORD_KEY, BPOTreeAgentLoop
from verl_bpo.integration.estimator import compute_bpo_advantage
from verl_bpo.demo.tiny_model import build_tiny_model
from verl_bpo.integration.trainer import batch_tree_metrics, column, rollout_states
from verl_bpo.core.leaf_meta import META_KEY


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


class TokenOutput:
    def __init__(self, token_ids, log_probs, step=3):
        self.token_ids, self.log_probs = token_ids, log_probs
        # as verl's LLMServerClient.generate fills them: the weight version that produced the tokens
        self.extra_fields = {"global_steps": step, "min_global_steps": step, "max_global_steps": step}


class FakeServer:
    """Scripted fake of verl's LLMServerClient: a random smoke action, tokenized, with log-probs."""

    def __init__(self, tokenizer, seed=0):
        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        self.request_ids, self.seeds = [], []  # seeds: each request's sampling seed (None: unseeded)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        self.request_ids.append(request_id)
        self.seeds.append(sampling_params.get("seed"))
        action = self.rng.choice(["east", "west", "take key", "open door"])
        ids = self.tokenizer.encode(action) + [self.tokenizer.eos_token_id]
        return TokenOutput(ids, [math.log(0.25) / len(ids)] * len(ids))


def make_config(estimator="bpo", n=4, **bpo):
    """A verl config for the agent loop; ``bpo``: fields of the ``bpo`` block (K0 = K = 2 under the fixed rule)."""
    fixed = {} if bpo.get("allocation") == "learned" else {"fixed": {"k": 2, "k0": 2}}
    base = {
        "algorithm": {"adv_estimator": estimator, "gamma": 1.0},
        "actor_rollout_ref": {"rollout": {"prompt_length": 512, "response_length": 256, "n": n,
                                          "multi_turn": {}, "agent": {}}},
        "data": {},
        "bpo": {**fixed, "max_turns": 5, "sandbox": {"name": "smoke", "config": {}}, **bpo},
    }
    return OmegaConf.create(base)


def make_loop(config, tokenizer, server):
    return BPOTreeAgentLoop(
        trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=None, data_config=DictConfigWrap(config.data), hf_model_type="qwen2",
    )


def training_state(config, sessions, policy=None):
    """The STATE_KEY column the BPO trainer gives every training row (a fresh run's state by default)."""
    bpo = BPOConfig.from_mapping(OmegaConf.to_container(config.bpo)).for_estimator(config.algorithm.adv_estimator)
    return rollout_states(policy or ForkPolicy(bpo), sessions, [None], {"name": "smoke", "config": {}})[0]


async def run_sessions(config, tokenizer, n, uid="uid-a", task_id=2, validate=False):
    server = FakeServer(tokenizer)
    row = {"uid": uid, "index": 0, "extra_info": {"task": {"task_id": task_id}}}
    if not validate:  # verl's _validate submits rows without the trainer's state
        row[STATE_KEY] = training_state(config, n)
    # Like AgentLoopWorkerTQ._run_prompt: n tasks created in one go, each with its own loop instance.
    tasks = [asyncio.create_task(make_loop(config, tokenizer, server).run({"temperature": 1.0}, session_id=i, **row))
             for i in range(n)]
    return await asyncio.gather(*tasks), server


def test_sessions_of_one_uid_get_distinct_leaves_of_one_tree(tokenizer):
    outputs, server = asyncio.run(run_sessions(make_config(n=6), tokenizer, n=6))
    metas = [o.extra_fields[META_KEY] for o in outputs]
    assert sorted(m["leaf_id"] for m in metas) == list(range(6))
    assert {m["tree_id"] for m in metas} == {"uid-a"}
    assert len({tuple(m["node_path"]) for m in metas}) == 6
    assert np.isclose(sum(m["leaf_mass"] for m in metas), 1.0)
    assert TREE_METRICS_KEY in outputs[0].extra_fields and TREE_METRICS_KEY not in outputs[1].extra_fields
    assert set(server.request_ids) == {"bpo-uid-a"}
    assert not BPOTreeAgentLoop._trees  # the registry entry is gone once every session collected
    # verl's trainer reads every row's weight-version range (trainer_base._compute_metrics).
    assert all(o.extra_fields["min_global_steps"] == o.extra_fields["max_global_steps"] == 3 for o in outputs)
    # The prompt is the chat-templated system + task message; environment tokens carry mask 0.
    out = outputs[0]
    assert tokenizer.decode(out.prompt_ids).startswith("<|im_start|>system")
    assert 0 in out.response_mask and 1 in out.response_mask
    assert len(out.response_logprobs) == len(out.response_ids) == len(out.response_mask)


def test_metadata_round_trips_through_as_dict_and_the_transfer_queue_layout(tokenizer):
    outputs, _ = asyncio.run(run_sessions(make_config(n=4), tokenizer, n=4))
    fields = [o.as_dict() for o in outputs]
    for f, o in zip(fields, outputs):
        f["uid"] = "uid-a"
        assert f["rm_scores"].sum().item() == pytest.approx(o.reward_score)
    td = list_of_dict_to_tensordict(fields)
    extra = column(td, "extra_fields")
    assert [e[META_KEY] for e in extra] == [o.extra_fields[META_KEY] for o in outputs]
    # The trainer's side: metrics from the fetched extra fields, then the estimator on the padded batch.
    metrics = batch_tree_metrics(["uid-a"] * 4, extra)
    assert metrics["bpo/leaves"] == 4 and "bpo/failed_leaf_rate" in metrics
    mask = torch.nn.utils.rnn.pad_sequence([f["response_mask"] for f in fields], batch_first=True).float()
    scores = torch.nn.utils.rnn.pad_sequence([f["rm_scores"] for f in fields], batch_first=True)
    adv, _ = compute_bpo_advantage(scores, mask, index=np.array(["uid-a"] * 4, dtype=object),
                                   tree_meta=[e[META_KEY] for e in extra])
    assert torch.all(adv[mask == 0] == 0)


def test_a_sandbox_that_never_starts_still_fills_the_uid_group(tokenizer, monkeypatch):
    """verl stops the step on a uid group with no trajectories; a dead reset gives N failed, zero-advantage rows."""
    UnstartableSmoke.failures, UnstartableSmoke.resets = 100, 0
    monkeypatch.setattr(agent_loop, "make_sandbox", lambda name, config: UnstartableSmoke(config))
    outputs, _ = asyncio.run(run_sessions(make_config(n=4), tokenizer, n=4))
    fields = [o.as_dict() for o in outputs]  # verl writes the reward on the last response token: it must exist
    assert len(fields) == 4 and all(f["rm_scores"].sum() == 0 and f["response_mask"].sum() == 0 for f in fields)
    assert all(o.extra_fields["bpo_leaf"]["failed"] for o in outputs)
    assert outputs[0].extra_fields[TREE_METRICS_KEY]["bpo/reset_failures"] == 1


@pytest.mark.parametrize("sessions", [1, 4])
def test_validation_plays_independent_episodes_and_teaches_nothing(tokenizer, sessions):
    """A row without the trainer's state (verl's _validate) gets one independent episode per session, as a GRPO run
    validates, so verl's val-core mean@n is a plain mean over episodes; no tree record leaves validation."""
    outputs, _ = asyncio.run(run_sessions(make_config(n=4, allocation="learned"), tokenizer, n=sessions,
                                          validate=True))
    metas = [o.extra_fields[META_KEY] for o in outputs]
    assert len(outputs) == sessions and all(m["leaf_mass"] == 1.0 for m in metas)
    assert len({m["tree_id"] for m in metas}) == sessions  # one episode each, never one tree
    assert all(o.extra_fields[TREE_METRICS_KEY]["bpo/forks"] == 0 for o in outputs)
    assert not any(TREE_RECORD_KEY in o.extra_fields for o in outputs)


def test_grpo_gets_flat_groups_through_the_same_loop(tokenizer):
    outputs, _ = asyncio.run(run_sessions(make_config(estimator="grpo", n=4), tokenizer, n=4))
    metas = [o.extra_fields[META_KEY] for o in outputs]
    assert len({m["node_path"][1] for m in metas}) == 4  # four independent first turns
    assert all(m["leaf_mass"] == 0.25 for m in metas)


def test_bad_bpo_key_is_named(tokenizer):
    with pytest.raises(ValueError, match=r"unknown bpo config key\(s\) \['kk'\]"):
        asyncio.run(run_sessions(make_config(n=2, kk=3), tokenizer, n=2))


def test_dataset_rows_from_verl_bpo_data_drive_the_loop(tokenizer, tmp_path):
    import pandas as pd

    from verl_bpo.data import sandbox_rows, write_sandbox_dataset

    rows = sandbox_rows("smoke", [{"task_id": 1}, {"task_id": 5}], {"length": 5})
    path = write_sandbox_dataset(tmp_path / "train.parquet", rows)
    back = pd.read_parquet(path).to_dict("records")
    assert back[0]["agent_name"] == "bpo_tree" and back[0]["prompt"][0]["role"] == "system"
    row = {"uid": "uid-d", "index": 0, "extra_info": back[1]["extra_info"],
           STATE_KEY: training_state(make_config(n=2), 2)}

    async def go():
        server = FakeServer(tokenizer)
        loops = [make_loop(make_config(n=2), tokenizer, server) for _ in range(2)]
        return await asyncio.gather(*(asyncio.create_task(lp.run({}, session_id=i, **row))
                                      for i, lp in enumerate(loops)))

    outputs = asyncio.run(go())
    assert tokenizer.decode(outputs[0].prompt_ids).count("room") >= 1
    assert {o.extra_fields[META_KEY]["tree_id"] for o in outputs} == {"uid-d"}


# --- a row's own tree budget (extra_info.bpo_budget) ---------------------------------------------------------------
def test_row_budget_reads_the_field_and_refuses_bad_values():
    from verl_bpo.integration.agent_loop import row_budget, row_task

    assert row_budget({"task": "{}"}) is None and row_budget({"bpo_budget": None}) is None  # absent, or null
    assert row_budget({"bpo_budget": np.float64(96.0)}) == 96.0 and row_budget({"bpo_budget": 3}) == 3.0
    for bad in (0, -5.0, float("nan"), float("inf"), "100", True):
        with pytest.raises(ValueError, match=r"extra_info\.bpo_budget of uid u7 must be a positive number"):
            row_budget({"bpo_budget": bad}, "u7")
    where = row_task({"task": '{"task_id": 3}', "bpo_budget": 40.0}, {"name": "smoke", "config": {}})
    assert where.budget == 40.0 and where.task == {"task_id": 3}
    # the budget is no part of the task's identity: its learned episode cost stays keyed the same
    assert where.key == row_task({"task": {"task_id": 3}}, {"name": "smoke", "config": {}}).key


async def _grow_rows(config, tokenizer, rows, sessions):
    """Every session of ``rows`` (training rows of ``rollout_states``), as verl's worker starts them."""
    server = FakeServer(tokenizer)
    tasks = [[asyncio.create_task(make_loop(config, tokenizer, server).run({"temperature": 1.0}, session_id=i, **row))
              for i in range(sessions)] for row in rows]
    return [[o for o in await asyncio.gather(*group) if o != []] for group in tasks]


def test_a_rows_budget_is_its_trees_budget_and_every_trees_spend_is_logged(tokenizer, tmp_path):
    """extra_info.bpo_budget reaches the sampler as the tree's root budget (bpo/budget, bpo/budget_from_row); the
    trainer's tree log lists every tree's task and spend, read from the rows as TransferQueue returns them."""
    import json

    from verl_bpo.integration.agent_loop import TREE_TASK_KEY
    from verl_bpo.integration.trainer import append_tree

    config = make_config(n=4, allocation="learned", learned={"budget_unit": "tokens", "max_leaves": 8,
                                                            "warmup_trees": 0, "explore_share": 0.0})
    bpo = BPOConfig.from_mapping(OmegaConf.to_container(config.bpo)).for_estimator("bpo")
    extra_infos = [{"task": {"task_id": 1}, "bpo_budget": 37.0}, {"task": {"task_id": 2}}]
    states = rollout_states(ForkPolicy(bpo), 8, extra_infos, {"name": "smoke", "config": {}})
    rows = [{"uid": f"u{i}", "index": i, "extra_info": e, STATE_KEY: s}
            for i, (e, s) in enumerate(zip(extra_infos, states))]
    given, learned = asyncio.run(_grow_rows(config, tokenizer, rows, 8))
    metrics = given[0].extra_fields[TREE_METRICS_KEY]
    assert metrics["bpo/budget"] == 37.0 and metrics["bpo/budget_from_row"] == 1.0
    assert learned[0].extra_fields[TREE_METRICS_KEY]["bpo/budget_from_row"] == 0.0
    assert learned[0].extra_fields[TREE_METRICS_KEY]["bpo/budget"] != 37.0
    assert given[0].extra_fields[TREE_TASK_KEY] == {"task_id": 1}
    assert all(TREE_TASK_KEY not in o.extra_fields for o in given[1:])  # leaf 0 only, as the metrics

    fields = [o.as_dict() for o in given + learned]
    uids = ["u0"] * len(given) + ["u1"] * len(learned)
    extra = column(list_of_dict_to_tensordict(fields), "extra_fields")
    log = tmp_path / "trees.jsonl"
    append_tree(str(log), 3, uids, extra)
    line = json.loads(log.read_text())
    assert line["step"] == 3 and line["uid"] == "u0" and len(line["leaves"]) == len(given)
    trees = line["trees"]
    assert [t["uid"] for t in trees] == ["u0", "u1"] and [t["task"] for t in trees] == [{"task_id": 1}, {"task_id": 2}]
    assert trees[0]["budget"] == 37.0
    for tree, outs in zip(trees, (given, learned)):
        assert tree["generated_tokens"] == outs[0].extra_fields[TREE_METRICS_KEY]["bpo/generated_tokens"] > 0
        assert tree["env_steps"] == outs[0].extra_fields[TREE_METRICS_KEY]["bpo/env_steps"] > 0


def test_flat_groups_ignore_a_rows_budget_and_log_their_task(tokenizer):
    """GRPO's groups run through the same loop: a row's budget changes nothing there, and leaf 0 names the task
    (the tree log's per-task spend of a GRPO run)."""
    from verl_bpo.integration.agent_loop import TREE_TASK_KEY

    config = make_config(estimator="grpo", n=4, allocation="learned",
                         learned={"budget_unit": "tokens", "max_leaves": 8})
    extra_info = {"task": {"task_id": 4}, "bpo_budget": 5.0}
    row = {"uid": "g", "index": 0, "extra_info": extra_info, STATE_KEY: training_state(config, 4)}
    (outputs,) = asyncio.run(_grow_rows(config, tokenizer, [row], 4))
    assert len(outputs) == 4 and outputs[0].extra_fields[TREE_TASK_KEY] == {"task_id": 4}
    metrics = outputs[0].extra_fields[TREE_METRICS_KEY]
    assert "bpo/budget" not in metrics and "bpo/budget_from_row" not in metrics
