"""One learned allocation state per run: learned by the trainer from every tree of a step, whichever worker grew it,
handed to every worker, checkpointed and restored; validation never reads or feeds it.

The agent loop runs as verl's v1 worker runs it (every session of a uid an asyncio task, a real tiny tokenizer,
verl's continuous-token builder); the LLM server is the scripted fake of ``test_agent_loop``. Two workers are two
event loops, each growing its share of a step's tasks from the same rows.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from omegaconf import OmegaConf

from tests.test_agent_loop import FakeServer, make_config, make_loop, tokenizer  # noqa: F401  (fixture)
from verl_bpo.core.config import BPOConfig, LearnedAllocation
from verl_bpo.core.fork_policy import ForkPolicy
from verl_bpo.core.profile import TreeRecord
from verl_bpo.integration import trainer as trainer_module
from verl_bpo.integration.agent_loop import (
    STATE_KEY,
    TREE_METRICS_KEY,
    TREE_RECORD_KEY,
    BPOTreeAgentLoop,
    row_task,
)
from verl_bpo.integration.trainer import (
    STATE_FILE,
    BPOTrainer,
    batch_tree_metrics,
    check_reset_failures,
    learn_from_batch,
    rollout_states,
)

LEARNED = {"allocation": "learned",
           "learned": {"budget_unit": "turns", "max_leaves": 8, "warmup_trees": 4, "explore_share": 0.0}}


def bpo_config(config) -> BPOConfig:
    return BPOConfig.from_mapping(OmegaConf.to_container(config.bpo)).for_estimator(config.algorithm.adv_estimator)


SMOKE = {"name": "smoke", "config": {}}


def rows(uids, tasks, run=None, sessions=8):
    """Dataset rows as the agent loop gets them; with ``run``, training rows carrying its state as the BPO trainer
    hands it out (``rollout_states``), else validation rows."""
    extra_infos = [{"task": {"task_id": task}} for task in tasks]
    states = rollout_states(run, sessions, extra_infos, SMOKE) if run is not None else [None] * len(uids)
    out = []
    for uid, extra_info, state in zip(uids, extra_infos, states):
        row = {"uid": uid, "index": 0, "extra_info": extra_info}
        if state is not None:
            row[STATE_KEY] = state
        out.append(row)
    return out


async def grow_on_one_worker(config, tokenizer, batch_rows, sessions, seed=0, stagger_s=0.0):  # noqa: F811
    """Every session of ``batch_rows`` on one worker's event loop; returns (uid, outputs) per row. With
    ``stagger_s`` the sessions start in shuffled order, awaiting between starts (verl promises no order)."""
    server = FakeServer(tokenizer, seed=seed)
    order = [(r, i) for r in batch_rows for i in range(sessions)]
    if stagger_s:
        random.Random(seed).shuffle(order)
    tasks = {}
    for row, i in order:
        loop = make_loop(config, tokenizer, server)
        tasks[(row["uid"], i)] = asyncio.create_task(loop.run({"temperature": 1.0}, session_id=i, **row))
        if stagger_s:
            await asyncio.sleep(stagger_s)
    done = {key: await task for key, task in tasks.items()}
    return [(r["uid"], [done[(r["uid"], i)] for i in range(sessions)]) for r in batch_rows], server


def batch_fields(grown):
    """The trainer's view of a step: (uids, extra_fields) of every output row, in batch order."""
    uids, extras = [], []
    for uid, outputs in grown:
        for out in outputs:
            if out != []:
                uids.append(uid)
                extras.append(out.extra_fields)
    return uids, extras


@pytest.fixture
def planned_states(monkeypatch):
    """The state every tree's plan was made from (ForkPolicy.start_tree), in start order."""
    states = []
    start_tree = ForkPolicy.start_tree

    def recording(self, *args, **kwargs):
        states.append(json.dumps(self.state_dict(task_keys=()), sort_keys=True))
        return start_tree(self, *args, **kwargs)

    monkeypatch.setattr(ForkPolicy, "start_tree", recording)
    return states


def test_every_worker_plans_on_the_run_state_learned_from_every_tree(tokenizer, planned_states):  # noqa: F811
    """Step 1's trees, grown on two workers, teach the trainer's one policy exactly what one policy learns from the
    same trees; step 2's trees plan on that state on both workers (and the workers keep none of their own)."""
    config = make_config(n=4, **LEARNED)
    run = ForkPolicy(bpo_config(config))
    step_rows = rows([f"s1-{i}" for i in range(6)], [1, 2, 3, 1, 2, 3], run)
    grown = (asyncio.run(grow_on_one_worker(config, tokenizer, step_rows[:3], 8, seed=1))[0]
             + asyncio.run(grow_on_one_worker(config, tokenizer, step_rows[3:], 8, seed=2))[0])
    uids, extras = batch_fields(grown)
    assert learn_from_batch(run, uids, extras) == 6
    one_worker = ForkPolicy(bpo_config(config))  # the same trees, learned where they grew, one after another
    for _, outputs in grown:
        one_worker.learn(TreeRecord.from_dict(outputs[0].extra_fields[TREE_RECORD_KEY]))
    assert json.dumps(run.state_dict(), sort_keys=True) == json.dumps(one_worker.state_dict(), sort_keys=True)
    assert run.trees_learned == 6 and run.profile.trees > 0

    planned_states.clear()
    step2 = rows([f"s2-{i}" for i in range(4)], [1, 2, 3, 4], run)
    asyncio.run(grow_on_one_worker(config, tokenizer, step2[:2], 8, seed=3))
    asyncio.run(grow_on_one_worker(config, tokenizer, step2[2:], 8, seed=4))
    expected = json.dumps(run.state_dict(task_keys=()), sort_keys=True)
    assert planned_states == [expected] * 4  # both workers, every tree: the trainer's state, nothing learned locally
    assert not hasattr(BPOTreeAgentLoop, "_policies")


def test_each_row_carries_the_state_with_its_own_tasks_cost_only():
    """verl stores a row's fields with each of its outputs: a row carries the profile and its own task's cost."""
    policy = ForkPolicy(BPOConfig(mode="tree", **LEARNED))
    tasks = [{"task": {"task_id": t}} for t in (1, 2, 3)]
    for extra in tasks:
        key = row_task(extra, SMOKE).key
        policy.learn(TreeRecord([(0, 1, 2)], [1.0], [1.0], {}, {1: 3.0, 2: 4.0}, plan="explore", task_key=key))
    states = [json.loads(s) for s in rollout_states(policy, 8, [*tasks, {"task": {"task_id": 9}}], SMOKE)]
    assert all(s["sessions"] == 8 for s in states)
    assert [list(s["policy"]["task_costs"]) for s in states] == [[row_task(t, SMOKE).key] for t in tasks] + [[]]
    assert all(s["policy"]["profile"] == policy.state_dict()["profile"] for s in states)


def test_a_task_seen_before_is_budgeted_on_its_own_episode_cost():
    """N flat rollouts of this task: N times the task's last measured episode, scaled by the sandbox's drift since;
    a task not seen yet gets the sandbox's average episode."""
    config = BPOConfig(mode="tree", allocation="learned", max_turns=4,
                       learned=LearnedAllocation(budget_unit="tokens", warmup_trees=0))
    policy = ForkPolicy(config)
    long_task = TreeRecord([(0, 1, 2, 3)], [1.0], [1.0], {}, {1: 10.0, 2: 10.0, 3: 10.0}, plan="learned",
                           task_key="long")
    short_task = TreeRecord([(0, 4)], [0.0], [1.0], {}, {4: 2.0}, plan="learned", task_key="short")
    policy.learn(long_task)
    policy.learn(short_task)
    average = policy.profile.episode_cost("tokens")
    assert long_task.episode_cost("tokens") == 30.0 and short_task.episode_cost("tokens") == 2.0
    short = policy.start_tree(4, seed=1, task_key="short")
    assert short.budget_source == "task" and short.budget.root_budget == pytest.approx(4 * 2.0)  # no drift since
    long = policy.start_tree(4, seed=1, task_key="long")
    drift = average / policy.task_costs["long"]["sandbox_tokens"]  # the sandbox average moved since "long"
    assert long.budget_source == "task" and long.budget.root_budget == pytest.approx(4 * 30.0 * drift)
    unseen = policy.start_tree(4, seed=1, task_key="new")
    assert unseen.budget_source == "sandbox" and unseen.budget.root_budget == pytest.approx(4 * average)
    assert unseen.metrics()["bpo/budget_from_task"] == 0.0 and short.metrics()["bpo/budget_from_task"] == 1.0


def test_validation_never_reads_or_feeds_the_state(tokenizer, planned_states):  # noqa: F811
    """verl's _validate rows carry no state: each session plays one flat episode (no plan reads the learned state)
    and no record leaves validation, so the trainer's policy learns nothing from it."""
    config = make_config(n=4, **LEARNED)
    grown, _ = asyncio.run(grow_on_one_worker(config, tokenizer, rows(["v-0", "v-1"], [1, 2]), 4))
    uids, extras = batch_fields(grown)
    assert len(uids) == 8 and not any(TREE_RECORD_KEY in e for e in extras)
    run = ForkPolicy(bpo_config(config))
    assert learn_from_batch(run, uids, extras) == 0 and run.trees_started == 0
    # every plan was made by a fresh, never-taught policy (flat: its plan reads nothing learned)
    assert len(planned_states) == 8 and len(set(planned_states)) == 1
    assert json.loads(planned_states[0])["trees_learned"] == 0
    assert all(e["bpo"]["leaf_mass"] == 1.0 for e in extras)


def test_sessions_that_arrive_in_any_order_still_share_one_tree(tokenizer):  # noqa: F811
    """The tree's session count comes from the trainer's state, not from who registered before the tree started:
    sessions started in shuffled order, with awaits between, all get their leaf of one tree."""
    config = make_config(n=4)
    run = ForkPolicy(bpo_config(config))
    grown, _ = asyncio.run(grow_on_one_worker(config, tokenizer, rows(["r-0", "r-1"], [1, 2], run, 4), 4,
                                              seed=5, stagger_s=0.01))
    for uid, outputs in grown:
        metas = [o.extra_fields["bpo"] for o in outputs]
        assert sorted(m["leaf_id"] for m in metas) == [0, 1, 2, 3] and {m["tree_id"] for m in metas} == {uid}
        assert sum(m["leaf_mass"] for m in metas) == pytest.approx(1.0)
    assert not BPOTreeAgentLoop._trees


@pytest.mark.parametrize(("full_determinism", "engine"), [(False, "vllm"), (True, "vllm"), (True, "sglang")])
def test_request_ids_are_unique_per_generation_where_the_engine_sees_them(tokenizer, full_determinism,  # noqa: F811
                                                                           engine):
    """verl hands the engine a fresh id per turn unless rollout.full_determinism=True, where it passes ours through
    (concurrent requests with one id collide in the engine): then every generation gets its own id, and on vLLM
    its own sampling seed (SGLang takes none under that name)."""
    config = make_config(n=4)
    config.actor_rollout_ref.rollout.full_determinism = full_determinism
    config.actor_rollout_ref.rollout.name = engine
    run = ForkPolicy(bpo_config(config))
    _, server = asyncio.run(grow_on_one_worker(config, tokenizer, rows(["q-0"], [1], run, 4), 4))
    if full_determinism:
        assert len(set(server.request_ids)) == len(server.request_ids) > 4
        assert all(r.startswith("bpo-q-0-") for r in server.request_ids)
    else:
        assert set(server.request_ids) == {"bpo-q-0"}  # sticky routing: one id per tree
    if full_determinism and engine == "vllm":
        assert None not in server.seeds and len(set(server.seeds)) == len(server.seeds)
    else:
        assert set(server.seeds) == {None}


def test_the_metrics_log_one_profile(tokenizer):  # noqa: F811
    """Per-tree metrics carry no profile (an average of per-worker profiles would be no profile at all); the
    trainer logs its one policy's."""
    config = make_config(n=4, **LEARNED)
    run = ForkPolicy(bpo_config(config))
    grown, _ = asyncio.run(grow_on_one_worker(config, tokenizer, rows(["m-0"], [1], run), 8))
    uids, extras = batch_fields(grown)
    assert not any(k.startswith("bpo/profile/") for k in batch_tree_metrics(uids, extras))
    learn_from_batch(run, uids, extras)
    assert run.metrics()["bpo/profile/trees_learned"] == 1.0 and "bpo/profile/survival/d0" in run.metrics()


class _Trainer(BPOTrainer):
    """BPOTrainer without verl's workers: only the checkpoint hooks run (verl's own parts are stubbed)."""

    def __init__(self, folder, warmup):  # noqa: D107  (skips verl's __init__, which starts workers)
        self.config = OmegaConf.create({"trainer": {"default_local_dir": str(folder), "resume_mode": "auto",
                                                    "resume_from_path": None}})
        self.fork_policy = ForkPolicy(BPOConfig(
            mode="tree", allocation="learned", learned={**LEARNED["learned"], "warmup_trees": warmup}))
        self.global_steps = 0


def test_a_resumed_run_continues_where_it_stopped(tmp_path, monkeypatch):
    """The state is saved in verl's checkpoint folder and restored on resume: no second warm-up."""
    saved_at = {}
    monkeypatch.setattr(trainer_module.PPOTrainerSync, "_save_checkpoint", lambda self: None)
    monkeypatch.setattr(trainer_module.PPOTrainerSync, "_load_checkpoint",
                        lambda self: setattr(self, "global_steps", saved_at.get("step", 0)))
    first = _Trainer(tmp_path, warmup=3)
    record = TreeRecord([(0, 1, 2), (0, 3)], [1.0, 0.0], [0.5, 0.5], {1: 0.2}, {1: 2.0, 2: 2.0, 3: 1.0},
                        plan="explore", task_key="t")
    for _ in range(3):
        assert first.fork_policy.start_tree(4, seed=0).kind == "explore"
        first.fork_policy.learn(record)
    first.global_steps = saved_at["step"] = 3
    first._save_checkpoint()
    assert (tmp_path / "global_step_3" / STATE_FILE).is_file()

    resumed = _Trainer(tmp_path, warmup=3)
    resumed._load_checkpoint()
    assert resumed.global_steps == 3
    assert resumed.fork_policy.state_dict() == json.loads(json.dumps(first.fork_policy.state_dict()))
    assert resumed.fork_policy.start_tree(4, seed=0).kind == "learned"  # the warm-up is over, as before the stop
    fresh = _Trainer(tmp_path / "elsewhere", warmup=3)
    saved_at["step"] = 0
    fresh._load_checkpoint()  # nothing to resume: a fresh state
    assert fresh.fork_policy.start_tree(4, seed=0).kind == "explore"

    (tmp_path / "global_step_3" / STATE_FILE).unlink()
    saved_at["step"] = 3
    with pytest.raises(FileNotFoundError, match="no BPO allocation state"):
        _Trainer(tmp_path, warmup=3)._load_checkpoint()


def test_a_step_where_most_trees_never_start_stops_the_run():
    def leaf(failed):
        return {"bpo": {}, TREE_METRICS_KEY: {"bpo/reset_failures": float(failed)},
                "bpo_leaf": {"error": "KeyError: 'task_id'" if failed else None}}

    check_reset_failures(["a", "b", "c"], [leaf(True), leaf(False), leaf(False)])  # one of three: go on
    with pytest.raises(RuntimeError, match=r"2 of this step's 3 trees never started.*KeyError: 'task_id'"):
        check_reset_failures(["a", "b", "c"], [leaf(True), leaf(True), leaf(False)])


def test_the_tree_log_lists_every_trees_task_and_spend(tmp_path):
    """bpo.tree_log: per step, the first tree in full and every tree's spend (a GRPO group's too), in batch order;
    verl's padding rows (copies of real rows) are no trees."""
    from verl_bpo.integration.agent_loop import TREE_TASK_KEY
    from verl_bpo.integration.trainer import append_tree

    def leaf(tree, first, tokens=0.0, steps=0.0, **metrics):
        extra = {"bpo": {"tree_id": tree}, "bpo_leaf": {"won": False}}
        if first:
            extra[TREE_METRICS_KEY] = {"bpo/generated_tokens": tokens, "bpo/env_steps": steps, **metrics}
            extra[TREE_TASK_KEY] = {"task_id": int(tree[1:])}
        return extra

    uids = ["t7", "t7", "t3", "t3", "t3", "pad_0"]
    extra = [leaf("t7", True, 60.0, 9.0, **{"bpo/budget": 64.0}), leaf("t7", False),
             leaf("t3", False), leaf("t3", True, 41.0, 6.0), leaf("t3", False), leaf("t7", True, 60.0, 9.0)]
    log = tmp_path / "logs" / "trees.jsonl"
    trainer_module.append_tree(str(log), 1, uids, extra)
    append_tree(str(log), 2, ["pad_1"], [leaf("t1", True, 5.0)])  # only padding: no line
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    assert line["step"] == 1 and line["uid"] == "t7" and len(line["leaves"]) == 2
    assert line["trees"] == [
        {"uid": "t7", "task": {"task_id": 7}, "generated_tokens": 60.0, "env_steps": 9.0, "budget": 64.0},
        {"uid": "t3", "task": {"task_id": 3}, "generated_tokens": 41.0, "env_steps": 6.0},
    ]
