"""The in-process rollout client and training loop behind benchmarks/learning.py, on a tiny locally built model."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_bpo.local.hf_client import BatchedHFClient, Generation, PrefixCache
from verl_bpo.local.trainer import LocalRL, LocalRLConfig
from verl_bpo.demo.tiny_model import build_tiny_model

SMOKE = {"length": 3, "max_steps": 4}
PATHS = {"max_turns": 3, "max_tokens_per_turn": 4}
BPO = {**PATHS, "fixed": {"k": 2, "k0": 2}}
# `slow` (outside the fast tier): the tests that generate and train more than one step; the fast tier keeps one
# step and the cheap checks.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _teacher_forced(model, prompt, token_ids):
    """The log-probabilities of ``token_ids`` after ``prompt`` from one full forward of the whole sequence."""
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None]).squeeze(-1).numpy()


def make_trainer(model_dir, estimator="bpo", **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = LocalRLConfig(estimator=estimator, rollout_n=4, batch_size=2, response_length=128,
                           bpo=kw.pop("bpo", BPO), **kw)
    return LocalRL(model, tokenizer, "smoke", SMOKE, config)


@pytest.mark.slow
def test_concurrent_requests_become_one_batched_generate_with_teacher_forced_log_probs(model_dir):
    trainer = make_trainer(model_dir)
    client, tokenizer = trainer.client, trainer.tokenizer
    prompts = [tokenizer(f"room {i} " * (i + 1))["input_ids"] for i in range(5)]  # different lengths: left padding

    async def generate_all():
        return await asyncio.gather(*(client.generate("r", prompt_ids=p, sampling_params={"max_tokens": 6})
                                      for p in prompts))

    outputs = asyncio.run(generate_all())
    assert client.calls == 1
    for prompt, out in zip(prompts, outputs):
        assert 1 <= len(out.token_ids) <= 6 and len(out.log_probs) == len(out.token_ids)
        np.testing.assert_allclose(out.log_probs, _teacher_forced(trainer.model, prompt, out.token_ids), atol=2e-4)


@pytest.mark.slow
def test_a_turn_that_extends_a_cached_sequence_prefills_only_its_new_tokens_with_the_same_log_probs(model_dir):
    """Second turns whose prompts extend the first turns' outputs (by different amounts, beside a prompt never seen,
    so rows mix cached prefixes of several lengths with left padding): the cache serves them and every sampled
    token's log-probability is still the full forward's."""
    trainer = make_trainer(model_dir)
    client, tokenizer = trainer.client, trainer.tokenizer
    first = [tokenizer(f"room {i} " * (i + 2))["input_ids"] for i in range(3)]

    def turn(prompts):
        async def generate_all():
            return await asyncio.gather(*(client.generate("r", prompt_ids=p, sampling_params={"max_tokens": 5})
                                          for p in prompts))
        return asyncio.run(generate_all())

    outputs = turn(first)
    assert client.cache.hits == 0 and len(client.cache._entries) == 3
    second = [p + o.token_ids + tokenizer(" door" * (i + 1))["input_ids"] for i, (p, o) in
              enumerate(zip(first, outputs))] + [tokenizer("a fresh prompt")["input_ids"]]
    calls = client.calls
    for prompt, out in zip(second, turn(second)):
        np.testing.assert_allclose(out.log_probs, _teacher_forced(trainer.model, prompt, out.token_ids), atol=2e-4)
    assert client.calls == calls + 1 and client.cache.hits == 3  # the fresh prompt found nothing
    client.forget()
    assert client.cache.tokens == 0 and client.cache.longest(second[0]) == (0, None)


def test_the_prefix_cache_finds_the_longest_strict_prefix_and_evicts_the_least_recently_used():
    cache = PrefixCache(max_tokens=7)
    cache.put([1, 2], ["a"])
    cache.put([1, 2, 3], ["b"])
    assert cache.longest([1, 2, 3, 4]) == (3, ["b"])
    assert cache.longest([1, 2, 3]) == (2, ["a"])  # a strict prefix: one token is left to compute
    assert cache.longest([9, 2, 3]) == (0, None)
    cache.put([5, 6, 7], ["c"])  # 8 tokens held: the least recently used entry, [1, 2, 3], goes
    assert cache.tokens == 5 and cache.longest([1, 2, 3, 4]) == (2, ["a"])
    assert PrefixCache(max_tokens=0).longest([1, 2]) == (0, None)


def test_each_row_samples_from_its_own_generator_with_the_tempered_probabilities():
    """The client's sampling step on fixed logits: 4000 seeds, one draw each, against softmax(logits / T). A
    chi-square test at p = 0.001 accepts the right distribution and must reject the untempered one (the negative
    control: at these frequencies its statistic's expected value is about 390, far past the 0.001 cut of 18.5 for
    4 degrees of freedom, so the control fails with probability well under 1e-6)."""
    from verl_bpo.local.hf_client import _RowSampler

    def chi_square(counts, probs):
        return float(((counts - probs * draws) ** 2 / (probs * draws)).sum())

    logits, temperature, draws = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), 0.7, 4000
    counts = np.zeros(5)
    for start in range(0, draws, 500):  # batches of 500 rows: each row's draw is its seed's alone
        only = _RowSampler(range(start, start + 500), temperature)(None, logits.repeat(500, 1))
        assert bool((torch.isfinite(only).sum(-1) == 1).all())
        counts += np.bincount(only.argmax(-1).numpy(), minlength=5)
    right = torch.softmax(logits / temperature, -1).numpy()
    untempered = torch.softmax(logits, -1).numpy()
    cut = 18.47  # chi-square's 0.999 quantile, 4 degrees of freedom
    assert chi_square(counts, right) < cut and chi_square(counts, untempered) > cut
    row = _RowSampler([7], temperature)(None, logits[None])
    again = _RowSampler([99, 7], temperature)(None, logits.repeat(2, 1))
    assert torch.equal(row[0], again[1])  # a seed's draw does not depend on its row or its batch


@pytest.mark.slow
def test_a_seeded_request_samples_the_same_turn_alone_or_in_any_batch(model_dir):
    trainer = make_trainer(model_dir)
    client, tokenizer = trainer.client, trainer.tokenizer
    client.cache = PrefixCache(0)  # every request prefills its whole prompt, in every batch
    prompts = [tokenizer(f"room {i} " * (i + 1))["input_ids"] for i in range(4)]

    def sample(requests):
        async def generate_all():
            return await asyncio.gather(*(client.generate("r", prompt_ids=prompts[i], sampling_params={
                "max_tokens": 6, "seed": seed}) for i, seed in requests))
        return [out.token_ids for out in asyncio.run(generate_all())]

    alone = sample([(0, 11)])[0]
    assert sample([(2, 5), (0, 11), (3, 8)])[1] == alone  # other rows, other padding: the same draw
    assert sample([(1, 1), (0, 11)])[1] == alone
    assert len({tuple(t) for t in sample([(0, s) for s in range(8)])}) > 1  # other seeds, other turns


@pytest.fixture
def late_smoke_steps(monkeypatch):
    """Smoke sandboxes whose steps answer after a random 0-30 ms on worker threads (as engine processes do), from an
    unseeded generator: the delays, and so the order branches and trees answer in, differ between rollouts."""
    import random

    from sandbox_adapters.smoke import SmokeSandbox

    jitter = random.Random()
    step = SmokeSandbox.step

    def late_step(self, action):
        time.sleep(jitter.uniform(0.0, 0.03))
        return step(self, action)

    monkeypatch.setattr(SmokeSandbox, "step", late_step)
    monkeypatch.setattr(SmokeSandbox, "blocking", True)  # called on threads, so delays reorder the branches


@pytest.mark.slow
def test_a_flat_group_is_the_same_whenever_its_sandboxes_answer(model_dir, late_smoke_steps):
    """Sandboxes that answer after random delays (as engine processes do) change which requests share a batch;
    each group's turns must not change with them."""
    trainer = make_trainer(model_dir, "rloo")

    def turns():
        results = trainer.rollout([{"task_id": 0}, {"task_id": 1}])
        return [tuple(leaf.transcript.response_ids) for r in results for leaf in r.leaves]

    first = turns()
    assert len(set(first)) > 1 and turns() == first and turns() == first


@pytest.mark.slow
def test_what_a_batch_teaches_the_fork_policy_does_not_follow_which_tree_finished_first(model_dir,
                                                                                      late_smoke_steps):
    """Concurrent trees finish in the order their sandboxes answer; the policy must learn from them in task order
    (as verl's trainer does from a batch), or the next batch's plans follow the latencies."""
    learned = {**PATHS, "allocation": "learned", "learned": {"budget_unit": "tokens", "warmup_trees": 2,
                                                              "max_leaves": 8}}

    def taught():
        trainer = make_trainer(model_dir, "bpo", bpo=learned)
        results = trainer.rollout([{"task_id": t} for t in range(4)])
        turns = [tuple(leaf.transcript.response_ids) for r in results for leaf in r.leaves]
        state = trainer.policies["bpo"].state_dict()
        assert state["trees_learned"] == 4
        # the profile's sums in the order learned; a turn's log-probabilities move in their last digits with the
        # requests it was batched with, so the profile is compared to 1e-4 (another order moves it by ~1e-2)
        return turns, np.concatenate([np.ravel(v) for v in state["profile"].values()])

    turns, profile = taught()
    for _ in range(2):
        again, again_profile = taught()
        assert again == turns
        np.testing.assert_allclose(again_profile, profile, rtol=1e-4, atol=1e-9)


@pytest.mark.timing  # gaps between the loop's ticks, in wall-clock seconds
def test_the_event_loop_runs_while_a_wave_generates():
    """Sandbox calls and their time limits live on the event loop: a long ``generate`` must not hold it (a wave
    longer than ``bpo.step_timeout_s`` fired the limits of engine calls that had already returned)."""
    client = BatchedHFClient.__new__(BatchedHFClient)
    client.max_batch, client.gather_s, client._pending, client._flusher = 4, 0.0, [], None

    def slow_generate(batch):
        time.sleep(0.5)
        return [Generation([1], [0.0]) for _ in batch]

    client._generate_batch = slow_generate
    ticks = []

    async def heartbeat():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    async def main():
        beat = asyncio.ensure_future(heartbeat())
        out = await client.generate("r", prompt_ids=[1, 2], sampling_params={"max_tokens": 1})
        beat.cancel()
        return out

    assert asyncio.run(main()).token_ids == [1]
    assert len(ticks) >= 20 and max(np.diff(ticks)) < 0.25  # on the loop: one gap of 0.5 s, two ticks

    def broken_generate(batch):
        raise RuntimeError("out of memory")

    client._generate_batch = broken_generate
    with pytest.raises(RuntimeError, match="out of memory"):  # the caller gets the error instead of hanging
        asyncio.run(main())


@pytest.mark.slow
def test_training_log_probs_match_the_rollout_on_generated_tokens(model_dir):
    trainer = make_trainer(model_dir)
    results = trainer.rollout([{"task_id": 0}, {"task_id": 1}])
    assert trainer.client.cache.hits > 0  # later turns and forks extend cached sequences
    leaves = [leaf for r in results for leaf in r.leaves]
    assert len(leaves) == 4 * 2 and len({leaf.meta.tree_id for leaf in leaves}) == 2
    length = max(len(leaf.transcript.response_mask) for leaf in leaves)
    with torch.no_grad():
        logp = trainer._response_log_probs(leaves, length)
    for row, leaf in enumerate(leaves):
        mask = np.array(leaf.transcript.response_mask, dtype=bool)
        np.testing.assert_allclose(logp[row, : len(mask)].numpy()[mask],
                                   np.array(leaf.transcript.response_logprobs)[mask], atol=2e-4)


def _with_returns(results, returns):
    """The same rollouts with the given leaf returns (on the last turn), for a known advantage pattern."""
    it = iter(returns)
    for r in results:
        for i, leaf in enumerate(r.leaves):
            value = float(next(it))
            rewards = (0.0,) * (leaf.meta.num_turns - 1) + (value,)
            r.leaves[i] = dataclasses.replace(leaf, reward=value, meta=dataclasses.replace(leaf.meta,
                                                                                           turn_rewards=rewards))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["bpo", "grpo"])
def test_equal_returns_give_no_gradient_and_different_returns_do(estimator, model_dir):
    trainer = make_trainer(model_dir, estimator)
    results = trainer.rollout([{"task_id": 0}, {"task_id": 1}])
    norm, batch = trainer.gradient(_with_returns(results, [1.0] * 8))
    assert norm == 0 and batch["advantages"].abs().sum() == 0
    norm, batch = trainer.gradient(_with_returns(results, [1, 0, 0, 1, 0, 0, 0, 1]))
    assert norm > 0 and batch["advantages"][batch["response_mask"] == 0].abs().sum() == 0


def test_a_step_updates_the_weights_and_reports_the_rollout(model_dir):
    trainer = make_trainer(model_dir, "grpo", lr=1e-2)
    stats = trainer.step([{"task_id": 2}, {"task_id": 3}])
    assert 0 <= stats.success_rate <= 1 and stats.env_steps > 0 and stats.generated_tokens > 0 and stats.trainer_rows == 4
    assert 0 <= stats.zero_advantage_share <= 1 and stats.grad_norm >= 0
    assert trainer.updates == 1 and trainer.optimizer.state  # AdamW took its step


def test_warm_start_chats_follow_the_expert_as_often_as_asked():
    from sandbox_adapters.smoke import SmokeSandbox
    from verl_bpo.demo.warm_start import random_policy_chats

    tasks = [{"task_id": i} for i in range(8)]

    def expert_share(prob):
        chats = random_policy_chats("smoke", {"length": 3, "max_steps": 8}, tasks, 64, 6, seed=3, expert_prob=prob)
        box, hits, turns = SmokeSandbox(SmokeSandbox.Config(length=3, max_steps=8)), 0, 0
        for i, chat in enumerate(chats):  # replay each chat and compare every action with the expert's choice
            box.reset(tasks[i % len(tasks)])
            for message in chat[2::2]:
                hits += message["content"] == box.best_action()
                turns += 1
                box.step(message["content"])
        return hits / turns

    assert expert_share(1.0) == 1.0
    assert 0.15 < expert_share(0.0) < 0.3  # one in five actions matches by chance
    with pytest.raises(ValueError, match="expert_prob"):
        random_policy_chats("textworld", {}, [{}], 1, 1, expert_prob=0.5)


@pytest.mark.slow
def test_warm_start_gives_tokens_its_chats_never_contain_the_mean_embedding(model_dir, tmp_path):
    """An untrained input row as context gives the next token's log-prob a gradient far above a trained token's (the
    heavy tail that dominated the learning benchmark's variance); the warm start mean-fills those rows."""
    from verl_bpo.demo.warm_start import _tokenize, random_policy_chats, warm_start

    tasks = [{"task_id": i} for i in range(4)]
    out = warm_start(model_dir, tmp_path / "ws", "smoke", tasks, SMOKE, episodes=8, max_turns=3, steps=4)
    tokenizer = AutoTokenizer.from_pretrained(out)
    seen = {t for chat in random_policy_chats("smoke", SMOKE, tasks, 8, 3) for t in _tokenize(tokenizer, chat)[0]}
    weight = AutoModelForCausalLM.from_pretrained(out).get_input_embeddings().weight.detach()
    unseen = sorted(set(range(weight.shape[0])) - seen)
    assert seen and unseen
    mean = weight[sorted(seen)].mean(0)
    assert torch.allclose(weight[unseen], mean.expand(len(unseen), -1), atol=1e-6)
    base = AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings().weight.detach()
    assert not torch.allclose(base[unseen], mean.expand(len(unseen), -1), atol=1e-3)  # the fill did something


def test_adam_eps_reaches_the_optimizer(model_dir):
    assert make_trainer(model_dir, adam_eps=1e-5).optimizer.param_groups[0]["eps"] == 1e-5


def learning_benchmark():
    """``benchmarks/learning.py`` as a module."""
    from tests.test_learning_summary import load

    return load("learning")


@pytest.mark.slow
def test_a_step_gives_each_tasks_tree_the_budget_it_is_handed(model_dir):
    """The learning benchmark matches BPO's tokens per update to a baseline's by handing each tree a budget."""
    trainer = make_trainer(model_dir, bpo={**PATHS, "allocation": "learned", "learned": {
        "budget_unit": "tokens", "warmup_trees": 0, "explore_share": 0.0}})
    results = trainer.rollout([{"task_id": 0}, {"task_id": 1}], budgets=[20.0, 45.0])
    assert [r.metrics["bpo/budget"] for r in results] == [20.0, 45.0]
    stats = trainer.step([{"task_id": 0}, {"task_id": 1}], budgets=[30.0, 30.0])
    assert len(stats.tree_tokens) == 2 and np.mean(stats.tree_tokens) == pytest.approx(stats.generated_tokens)


def test_learning_benchmark_signal_to_noise_from_gram_matrices():
    learning = learning_benchmark()
    rng = np.random.default_rng(0)
    mean = np.zeros(50)
    mean[0] = 3.0  # ‖E ĝ‖² = 9 against tr Cov = 50 · 0.25 = 12.5
    draws = mean + 0.5 * rng.standard_normal((4000, 50))
    assert learning.signal_to_noise(draws @ draws.T) == pytest.approx(9 / 12.5, rel=0.05)
    noise = 0.5 * rng.standard_normal((4000, 50))
    assert abs(learning.signal_to_noise(noise @ noise.T)) < 0.01


def test_learning_benchmark_summary_reports_the_double_batch_control_apart_from_matched_tokens():
    """RLOO with 2N rollouts is a control (what halving the variance buys in updates): it gets its own ratio to RLOO
    and never sets the matched-token point, which spends twice its tokens."""
    learning = learning_benchmark()
    batch = 4

    def run(tokens: float, curve: list[float]) -> dict:
        steps = [{"generated_tokens": tokens, "env_steps": 1.0, "trainer_rows": 8.0, "trained_tokens_leaf": 90.0,
                  "trained_tokens_packed": 60.0, "grad_norm": 0.01}] * 4
        return {"steps": steps, "curve": list(zip(range(0, 5, 2), curve)), "wall_s": 1.0}

    runs = {"grpo": [run(100, [0.3, 0.5, 0.8])] * 2, "rloo": [run(100, [0.3, 0.5, 0.8])] * 2,
            "bpo": [run(90, [0.3, 0.8, 0.9])] * 2, learning.CONTROL: [run(200, [0.3, 0.8, 0.9])] * 2}
    rng = np.random.default_rng(0)
    g = rng.standard_normal((6, 20))
    out = learning.summarize("late", runs, {"bpo": (g @ g.T, 1.0), "rloo": (g @ g.T, 1.0)}, target=0.75, updates=4,
                             eval_every=2, batch=batch)
    assert out["updates_to_target"][learning.CONTROL] == [2, 2] and out["updates_to_target"]["rloo"] == [4, 4]
    assert out["updates_to_target_rloo_2n_over_rloo"] == 0.5
    assert out["final_success_rloo_2n_minus_rloo"] == pytest.approx(0.2)
    assert out["matched_tokens"] == [90 * 4 * batch] * 2  # BPO's, not the control's or the baselines'
    assert learning.CONTROL not in out["success_at_matched_tokens"]


@pytest.mark.slow
def test_each_seed_gets_its_own_warm_start_and_seed_zero_keeps_its_cache(tmp_path):
    """benchmarks/learning.py's ``--warm-starts per-seed``: seed s is another warm start of the same recipe on the same
    base model (so a verdict's CI spans warm starts); seed 0 keeps the folder the records before it used."""
    from verl_bpo.demo.tasks import TASKS, task_model

    task = dataclasses.replace(TASKS["late"], warm_start={"episodes": 8, "max_turns": 3, "steps": 3})
    zero, one = task_model(tmp_path, task, seed=0), task_model(tmp_path, task, seed=1)
    assert (zero.name, one.name) == ("tiny_warm_late", "tiny_warm_late_seed1")
    assert task_model(tmp_path, task) == zero  # the default is warm start 0, rebuilt from its stamp, not retrained
    weights = [AutoModelForCausalLM.from_pretrained(d).get_output_embeddings().weight.detach() for d in (zero, one)]
    assert not torch.allclose(*weights)
    assert AutoTokenizer.from_pretrained(zero).get_vocab() == AutoTokenizer.from_pretrained(one).get_vocab()


@pytest.mark.slow
def test_a_decaying_warm_start_steps_at_a_rate_falling_linearly_to_zero(model_dir, tmp_path, monkeypatch):
    from verl_bpo.demo.warm_start import warm_start

    rates, step = [], torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    tasks = [{"task_id": i} for i in range(2)]
    warm_start(model_dir, tmp_path / "constant", "smoke", tasks, SMOKE, episodes=4, max_turns=3, steps=4, lr=1e-3)
    warm_start(model_dir, tmp_path / "decay", "smoke", tasks, SMOKE, episodes=4, max_turns=3, steps=4, lr=1e-3,
               decay=True)
    assert rates == pytest.approx([1e-3] * 4 + [1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
