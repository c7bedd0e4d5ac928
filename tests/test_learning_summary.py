"""The learning benchmark's summary and qualification rule (``benchmarks/learning.py``) on synthetic runs, no model.

A task counts for the paper's claims only when the control alone shows it is noise-limited: RLOO with 2N rollouts
reaches the target in <= 0.75x RLOO's updates, with the upper end of that ratio's CI95 below 1.0.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

UPDATES, EVAL_EVERY, BATCH, TARGET, SEEDS = 8, 2, 4, 0.75, 6


def load(script: str):
    """``benchmarks/<script>.py`` as a module (benchmarks are scripts, not a package; one may import another, as
    ``gradient_draws`` imports ``learning``, so their folder is on the path while it loads)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"{script}_benchmark", Path(folder) / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


learning = load("learning")


def run(curve: list[float], tokens: float = 100.0, leaf: float = 300.0, packed: float = 200.0,
        wall: float = 10.0) -> dict:
    """A synthetic run: evaluated every EVAL_EVERY updates from update 0; per-tree costs on every step."""
    steps = [{"generated_tokens": tokens, "env_steps": 5.0, "trainer_rows": 8.0, "trained_tokens_leaf": leaf,
              "trained_tokens_packed": packed, "grad_norm": 0.01, "tree_tokens": [tokens] * BATCH}] * UPDATES
    return {"curve": list(zip(range(0, UPDATES + 1, EVAL_EVERY), curve)), "steps": steps, "wall_s": wall}


SLOW = [0.3, 0.4, 0.5, 0.6, 0.8]  # reaches 0.75 at update 8; final (mean of the last two) 0.7
FAST = [0.3, 0.5, 0.8, 0.85, 0.85]  # reaches 0.75 at update 4; final 0.85
NEVER = [0.3, 0.4, 0.5, 0.6, 0.7]  # censored: counts as UPDATES + EVAL_EVERY = 10


def grams(scale_b: float = 2.0, draws: int = 16, dim: int = 30) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(1).standard_normal((draws, dim)) + 0.5
    return (scale_b * g) @ (scale_b * g).T, g @ g.T


def summarize(name: str, runs: dict, grads: dict) -> dict:
    return learning.summarize(name, runs, grads, target=TARGET, updates=UPDATES, eval_every=EVAL_EVERY, batch=BATCH)


def noise_limited_runs() -> dict:
    return {"rloo": [run(SLOW)] * SEEDS, learning.CONTROL: [run(FAST, tokens=200.0, leaf=600.0, packed=400.0)] * SEEDS,
            "grpo": [run(SLOW)] * SEEDS, "bpo": [run(FAST, tokens=90.0, leaf=500.0, packed=150.0, wall=12.0)] * SEEDS}


def test_a_noise_limited_task_qualifies_and_its_targets_are_evaluated():
    gram_b, gram_r = grams(scale_b=2.0)  # BPO's draws twice RLOO's: 4x the variance, at half the tokens: 2.0
    out = summarize("hard_late", noise_limited_runs(), {"bpo": (gram_b, 100.0), "rloo": (gram_r, 200.0)})
    assert out["updates_to_target"][learning.CONTROL] == [4] * SEEDS and out["updates_to_target"]["rloo"] == [8] * 6
    assert out["qualified"] is True
    assert out["updates_to_target_rloo_2n_over_rloo"] == 0.5
    assert out["ci95"]["updates_to_target_rloo_2n_over_rloo"] == [0.5, 0.5]
    assert out["qualification"]["qualified"] is True and out["qualification"]["max_ratio"] == 0.75
    assert out["qualification"]["updates_to_target_rloo_2n_over_rloo"] == 0.5
    assert out["final_success_rloo_2n_minus_rloo"] == pytest.approx(0.15)
    assert out["updates_to_target_bpo_over_grpo"] == 0.5
    assert out["final_success_bpo_minus_grpo"] == pytest.approx(0.15)
    assert out["grad_var_bpo_over_rloo"] == pytest.approx(2.0)
    targets = out["targets"]
    assert set(targets) == {"updates_to_target_bpo_over_grpo", "final_success_bpo_minus_grpo",
                            "grad_var_bpo_over_rloo"}
    assert targets["updates_to_target_bpo_over_grpo"] == {"target": "<= 0.62", "value": 0.5, "met": True}
    assert targets["final_success_bpo_minus_grpo"]["met"] is True
    assert targets["final_success_bpo_minus_grpo"]["target"] == ">= +0.036"
    assert targets["grad_var_bpo_over_rloo"] == {"target": "<= 0.5", "value": 2.0, "met": False}
    # per-update costs for every estimator, the control included: per tree x BATCH
    assert out["per_update"][learning.CONTROL] == {"generated_tokens": 800.0, "env_steps": 20.0, "trainer_rows": 32.0,
                                                   "trained_tokens_leaf": 2400.0, "trained_tokens_packed": 1600.0}
    assert out["per_update"]["bpo"]["trained_tokens_packed"] == 600.0
    assert out["per_update"]["bpo"]["trained_tokens_leaf"] == 2000.0
    assert out["wall_s_per_run"]["bpo"] == [12.0] * SEEDS and out["wall_s_per_run"]["grpo"] == [10.0] * SEEDS
    assert set(out["per_update"]) == {"bpo", "grpo", "rloo", learning.CONTROL}


def test_an_early_decision_task_has_the_tie_target_only():
    gram_b, gram_r = grams()
    runs = noise_limited_runs()
    runs["bpo"] = [run([0.3, 0.4, 0.5, 0.6, 0.74])] * SEEDS  # final 0.67 against RLOO's 0.7: -0.03 < -0.02
    out = summarize("hard_early", runs, {"bpo": (gram_b, 100.0), "rloo": (gram_r, 100.0)})
    assert out["qualified"] is True
    assert out["targets"] == {"final_success_bpo_minus_rloo": {"target": ">= -0.02", "value": -0.03, "met": False}}


def test_a_step_bound_task_does_not_qualify_and_its_targets_do_not_apply():
    runs = noise_limited_runs()
    runs[learning.CONTROL] = [run(SLOW, tokens=200.0)] * SEEDS  # twice the rollouts, the same updates
    gram_b, gram_r = grams()
    out = summarize("late", runs, {"bpo": (gram_b, 100.0), "rloo": (gram_r, 100.0)})
    assert out["updates_to_target_rloo_2n_over_rloo"] == 1.0
    assert out["ci95"]["updates_to_target_rloo_2n_over_rloo"] == [1.0, 1.0]
    assert out["qualified"] is False and out["qualification"]["qualified"] is False
    assert out["targets"] == "not applicable: task not noise-limited"
    assert out["updates_to_target_bpo_over_grpo"] == 0.5  # still reported


def test_borderline_ratio_with_an_upper_ci_at_or_above_one_does_not_qualify():
    # Mean 44/6 against 10: 0.733 <= 0.75, but one seed much slower makes the ratio uncertain: resamples that draw
    # that seed 3 times of 6 give (2 + 32 * 3 / 6) / 10 = 1.8, which the bootstrap's 97.5th percentile reaches.
    draws = np.random.default_rng(0).standard_normal((16, 50)) + 0.3
    q = learning.qualification([2, 2, 2, 2, 2, 34], [10] * 6, draws @ draws.T)
    assert q["updates_to_target_rloo_2n_over_rloo"] == pytest.approx(44 / 60, abs=1e-4)
    assert q["ci95"] == [0.2, 1.8]
    assert q["qualified"] is False
    assert q["snr_rloo"] == round(learning.signal_to_noise(draws @ draws.T), 4)
    assert q["snr_rloo_ci95"][0] < q["snr_rloo"] < q["snr_rloo_ci95"][1]
    # the same seeds without the slow one qualify; at exactly the bound with no spread too
    assert learning.qualification([2] * 6, [10] * 6)["qualified"] is True
    assert learning.qualification([6] * 6, [8] * 6)["qualified"] is True  # 0.75 <= 0.75, CI [0.75, 0.75]
    assert learning.qualification([7] * 6, [9] * 6)["qualified"] is False  # 0.778 > 0.75


def test_censored_seeds_count_as_updates_plus_eval_every():
    assert learning.updates_to_target(run(NEVER), TARGET, UPDATES + EVAL_EVERY) == 10
    assert learning.updates_to_target(run(SLOW), TARGET, UPDATES + EVAL_EVERY) == 8
    runs = noise_limited_runs()
    runs["rloo"] = [run(SLOW)] * 5 + [run(NEVER)]
    runs["grpo"] = [run(SLOW)] * 5 + [run(NEVER)]
    gram_b, gram_r = grams()
    out = summarize("hard_late", runs, {"bpo": (gram_b, 100.0), "rloo": (gram_r, 100.0)})
    assert out["censored_at"] == 10
    assert out["updates_to_target"]["rloo"] == [8, 8, 8, 8, 8, 10]
    assert out["qualification"]["updates_to_target"] == {learning.CONTROL: [4] * 6, "rloo": [8, 8, 8, 8, 8, 10]}
    assert out["updates_to_target_rloo_2n_over_rloo"] == 0.48  # 4 * 6 / (8 * 5 + 10)
    # a censored seed's tokens to target: its mean rate (100 per tree x 4) over 10 updates
    assert out["tokens_to_target"]["grpo"] == [3200] * 5 + [4000]


def test_runs_that_fell_to_no_success_and_every_seed_curve_are_reported():
    runs = noise_limited_runs()
    runs["bpo"] = [run(FAST)] * 4 + [run([0.3, 0.0, 0.0, 0.0, 0.0]), run([0.3, 0.4, 0.0, 0.5, 0.8])]
    runs["grpo"] = [run([0.0, 0.0, 0.4, 0.6, 0.8])] + [run(SLOW)] * 5  # a warm start at zero has not fallen
    gram_b, gram_r = grams()
    out = summarize("hard_late", runs, {"bpo": (gram_b, 100.0), "rloo": (gram_r, 100.0)})
    assert out["fallen_seeds"] == {"bpo": [4, 5], "grpo": [], "rloo": [], learning.CONTROL: []}
    assert out["curve_updates"] == [0, 2, 4, 6, 8]
    assert out["curves"]["bpo"][4] == [0.3, 0.0, 0.0, 0.0, 0.0] and len(out["curves"]["grpo"]) == SEEDS


def test_tokens_to_target_and_success_at_matched_tokens():
    r = {"steps": [{"generated_tokens": 10.0}, {"generated_tokens": 30.0}], "curve": [(0, 0.2), (2, 0.6)]}
    assert learning.tokens_until(r, 1, 4) == 40.0
    assert learning.tokens_until(r, 2, 4) == 160.0
    assert learning.tokens_until(r, 4, 4) == 320.0  # censored: its mean rate, 80 per update
    assert learning.success_at_tokens(r, 80.0, 4) == pytest.approx(0.4)  # half the tokens spent
    assert learning.success_at_tokens(r, 0.0, 4) == 0.2
    gram_b, gram_r = grams()
    out = summarize("hard_late", noise_limited_runs(), {"bpo": (gram_b, 100.0), "rloo": (gram_r, 100.0)})
    # BPO generated least (90 per tree x 4 x 8 = 2880); the control (twice RLOO's tokens) never sets the point
    assert out["matched_tokens"] == [2880] * SEEDS
    assert learning.CONTROL not in out["success_at_matched_tokens"]
    # GRPO at 2880 tokens = 7.2 updates of 400: between (6, 0.6) and (8, 0.8) -> 0.72; BPO at its end, 0.85
    assert out["success_at_matched_tokens"]["grpo"] == [0.72] * SEEDS
    assert out["success_at_matched_tokens"]["bpo"] == [0.85] * SEEDS
    assert out["success_at_matched_tokens_bpo_minus_grpo"] == pytest.approx(0.13)
    assert out["tokens_to_target"]["bpo"] == [1440] * SEEDS and out["tokens_to_target"]["grpo"] == [3200] * SEEDS
    assert out["tokens_to_target_bpo_over_grpo"] == 0.45


def test_signal_to_noise_ci95_covers_the_truth_and_counts_no_draw_against_itself():
    """Bootstrap over draws: a resample repeats draws, and a repeated draw paired with itself is not two draws
    (counted as two, pure noise reads about 1/64 here, and the CI excludes its true 0)."""
    rng = np.random.default_rng(3)
    noise = rng.standard_normal((64, 4000))
    lo, hi = learning.bootstrap(lambda i: learning.signal_to_noise(noise @ noise.T, i), 64)
    assert lo < 0 < hi < 0.005
    signal = rng.standard_normal((64, 4000)) + 0.2  # ‖E ĝ‖² / tr Cov = 4000 · 0.04 / 4000
    lo, hi = learning.bootstrap(lambda i: learning.signal_to_noise(signal @ signal.T, i), 64)
    assert lo < 0.04 < hi
    assert np.isnan(learning.signal_to_noise(noise @ noise.T, np.zeros(64, dtype=int)))
    tied = np.zeros((8, 5))  # every batch's returns tied: no gradient, no noise; a verdict, not a crash
    assert np.isnan(learning.qualification([4] * 6, [8] * 6, tied @ tied.T)["snr_rloo"])


def test_gradient_variance_ratio_and_signal_to_noise_match_numpy():
    rng = np.random.default_rng(7)
    g_b = rng.standard_normal((24, 40)) * 0.5 + 0.3
    g_r = rng.standard_normal((24, 40)) + 0.2
    out = summarize("hard_late", noise_limited_runs(), {"bpo": (g_b @ g_b.T, 120.0), "rloo": (g_r @ g_r.T, 100.0)})
    var_b, var_r = g_b.var(axis=0, ddof=1).sum(), g_r.var(axis=0, ddof=1).sum()
    assert out["grad_var_bpo_over_rloo"] == pytest.approx(var_b * 120.0 / (var_r * 100.0), abs=1e-4)

    def snr(g: np.ndarray) -> float:  # ‖E ĝ‖² unbiased: the mean inner product of distinct draws
        n = len(g)
        total = g.sum(axis=0)
        mean_sq = (total @ total - (g * g).sum()) / (n * (n - 1))
        return mean_sq / g.var(axis=0, ddof=1).sum()

    assert out["snr_rloo"] == pytest.approx(snr(g_r), abs=1e-4)
    assert out["qualification"]["snr_rloo"] == out["snr_rloo"]
    lo, hi = out["ci95"]["snr_rloo"]
    assert lo < out["snr_rloo"] < hi
    assert out["grad_signal_to_noise"]["bpo"] == pytest.approx(snr(g_b), abs=1e-4)
    # few draws: resamples that repeat one draw have no variance; they are left out of the CI, not a crash
    few = summarize("hard_late", noise_limited_runs(), {"bpo": (g_b[:3] @ g_b[:3].T, 1.0),
                                                        "rloo": (g_r[:3] @ g_r[:3].T, 1.0)})
    lo, hi = few["ci95"]["grad_var_bpo_over_rloo"]
    assert 0 < lo <= hi


def test_median_of_block_variances_is_not_carried_by_one_far_draw():
    """The robust tr Cov reads about the plain one on light tails, and one draw far out (a rare token under a heavy
    leaf) moves only its block, where it carries the plain estimate; the ratio of two sets follows it."""
    rng = np.random.default_rng(3)
    g = rng.standard_normal((96, 40))
    plain, robust = learning.trace_cov(g @ g.T), learning.trace_cov_median_of_means(g @ g.T)
    assert robust == pytest.approx(plain, rel=0.2) and plain == pytest.approx(40, rel=0.1)
    far = g.copy()
    far[95] *= 50.0
    assert learning.trace_cov(far @ far.T) > 15 * plain  # one draw of 96 carries the plain estimate ...
    assert learning.trace_cov_median_of_means(far @ far.T) == pytest.approx(robust, rel=0.1)  # ... not the median
    ratio = learning.variance_ratio(far @ far.T, 1.0, g @ g.T, 1.0, cov=learning.trace_cov_median_of_means)
    assert ratio(np.arange(96)) == pytest.approx(1.0, rel=0.1)
    assert learning.variance_ratio(far @ far.T, 1.0, g @ g.T, 1.0)(np.arange(96)) > 15


def test_a_task_already_at_the_target_does_not_qualify():
    q = learning.qualification([0] * 6, [0] * 6)  # 0 / 0: no updates to save
    assert q["qualified"] is False and np.isnan(q["updates_to_target_rloo_2n_over_rloo"])


def test_default_tasks_leave_out_the_step_bound_reference():
    assert learning.default_tasks() == ["hard_late", "hard_early"]  # the real-engine tasks are opt-in for now
    assert {"real_late", "real_early", "real_late_exit"} <= set(learning.BENCHMARK_TASKS)
    assert [learning.task_form(t) for t in ("late", "hard_late", "real_late", "real_late_exit", "early", "hard_early",
                                             "x", "latex")] == ["late", "late", "late", "late", "early", "early", None,
                                                                None]


def test_trained_tokens_of_a_tree_in_leaf_and_packed_layout():
    """Two leaves sharing their first turn ([10, 11]) below a 3-token prompt, then forking."""
    from verl_bpo.core.leaf_meta import LeafMeta
    from verl_bpo.local.trainer import trained_tokens
    from verl_bpo.rollout.protocols import Transcript
    from verl_bpo.rollout.tree_state import Leaf, TreeResult

    def leaf(i: int, path: tuple, response: list[int], spans: tuple) -> Leaf:
        transcript = Transcript([], [1, 2, 3, *response], 3, [1] * len(response), [0.0] * len(response),
                                [s for s, _ in spans])
        return Leaf(transcript, LeafMeta("t", i, path, spans, 0.5), 0.0)

    tree = TreeResult([leaf(0, (0, 1, 2), [10, 11, 20, 21, 22], ((0, 2), (2, 5))),
                       leaf(1, (0, 1, 3), [10, 11, 30], ((0, 2), (2, 3)))], {})
    # leaf rows: (3 + 5) + (3 + 3); packed: prompt 3 + shared turn 2 + [20, 21, 22] + a bridge + [30]
    assert trained_tokens(tree, 384) == (14, 10)
    cut = TreeResult([leaf(0, (0, 1, 2), [10, 11, 20, 21, 22], ((0, 2), (2, 4))), tree.leaves[1]], {})
    assert trained_tokens(cut, 4) == (13, 9)  # the first leaf's response cut at 4 tokens, as the trainer sends it
    flat = TreeResult([leaf(0, (0, 1), [10, 11], ((0, 2),)), leaf(1, (0, 2), [10, 11], ((0, 2),))], {})
    assert trained_tokens(flat, 384) == (10, 8)  # a flat group shares only its prompt (plus a bridge)


def test_a_saved_control_is_reused_only_under_the_settings_it_was_trained_with(tmp_path):
    """``--reuse-control``: the control's runs come back as saved, as many seeds as asked for or saved (the caller
    trains the rest); another learning rate or warm-start mode is refused with the field named, and so is a missing
    file."""
    import argparse
    import json

    args = argparse.Namespace(seeds=2, lr=None, adam_eps=1e-8, eval_every=EVAL_EVERY, eval_episodes=2,
                              warm_starts="per-seed")
    task = learning.TASKS["hard_late"]
    settings = learning.control_settings(args, task, UPDATES)
    saved = {"rloo": [run(SLOW), run(NEVER)], learning.CONTROL: [run(FAST), run(FAST)]}
    path = tmp_path / "control_hard_late.json"
    path.write_text(json.dumps({"settings": settings, **saved}))
    assert learning.reused_control(path, settings) == json.loads(json.dumps(saved))
    fewer = learning.control_settings(argparse.Namespace(**{**vars(args), "seeds": 1}), task, UPDATES)
    more = learning.control_settings(argparse.Namespace(**{**vars(args), "seeds": 6}), task, UPDATES)
    assert learning.reused_control(path, fewer) == json.loads(json.dumps({e: r[:1] for e, r in saved.items()}))
    assert learning.reused_control(path, more) == json.loads(json.dumps(saved))
    with pytest.raises(SystemExit, match="'warm_starts'"):
        learning.reused_control(path, {**more, "warm_starts": "one"})
    other = learning.control_settings(argparse.Namespace(**{**vars(args), "lr": 3e-4}), task, UPDATES)
    with pytest.raises(SystemExit, match="'lr'"):
        learning.reused_control(path, other)
    with pytest.raises(SystemExit, match="no saved control"):
        learning.reused_control(tmp_path / "control_hard_early.json", settings)


def test_a_real_engine_task_trains_on_the_games_under_its_output_directory(tmp_path):
    """A real-engine task names its games (made under ``--out``) and trains its longer episodes; an embedded task
    is only given the batch."""
    real = learning.runnable(learning.BENCHMARK_TASKS["real_late"], tmp_path, batch=3)
    assert real.batch == 3 and real.sandbox_config["games_dir"].startswith(str(tmp_path.resolve()))
    assert real.response_length > learning.BENCHMARK_TASKS["hard_late"].response_length
    hard = learning.runnable(learning.BENCHMARK_TASKS["hard_late"], tmp_path)
    assert hard == learning.TASKS["hard_late"] and "games_dir" not in hard.sandbox_config


def test_late_steps_make_a_sandboxs_steps_late_and_blocking_only_inside():
    """``gradient_draws.py``'s ``BPO_jittered`` set: inside, every step waits (here 0-40 ms, so ten steps wait
    0.2 s on average and at least 0.05 s with probability above 0.999) and is marked blocking, so the sampler runs
    it on a worker thread; outside, the class is as it was."""
    import time

    from sandbox_adapters.smoke import SmokeSandbox

    before = {name: vars(SmokeSandbox).get(name) for name in ("step", "blocking")}
    with learning.late_steps("smoke", 40.0, seed=1):
        assert SmokeSandbox.blocking is True
        box = SmokeSandbox()
        box.reset({"task_id": 0})
        start = time.perf_counter()
        for _ in range(10):
            box.step("look")
        assert time.perf_counter() - start > 0.05
    assert {name: vars(SmokeSandbox).get(name) for name in ("step", "blocking")} == before


def test_saved_sets_are_read_only_from_a_file_of_the_same_task_and_draws(tmp_path):
    """``gradient_draws.py --saved``: a saved set comes back as drawn; a file of another task, of another number
    of draws, or holding none of the sets named is refused."""
    draws = load("gradient_draws")
    gram = np.arange(9.0).reshape(3, 3)
    path = tmp_path / "gradient_draws_hard_late_3_A_BPO.npz"
    np.savez(path, A=gram, A_tokens=300.0)
    sets = {"A": {}, "BPO_r4k2": {}}
    read = draws.saved_sets(path, sets, "hard_late", 3)
    assert list(read) == ["A"] and np.array_equal(read["A"][0], gram) and read["A"][1:] == (300.0, None)
    for task, n, named, message in [("hard_early", 3, sets, "not drawn on --task hard_early"),
                                    ("hard_late", 4, sets, "holds 3 draws, not --draws 4"),
                                    ("hard_late", 3, {"BPO": {}}, "holds none of the sets BPO")]:
        with pytest.raises(SystemExit, match=message):
            draws.saved_sets(path, named, task, n)


def test_the_fixed_shape_sets_fork_every_root_path_once_where_the_door_is():
    """``gradient_draws.py``'s ``BPO_r4k2`` and ``BPO_r2k4``: the fixed rule's settings on ``hard_late`` grow K0
    root paths, each forked into K at depth ``length − 1`` (7), N = 8 leaves of equal mass; an agent that only walks
    east plays every episode to ``max_steps``, so every path reaches that depth."""
    import asyncio

    from tests.fakes import ScriptedLLM, WordCodec
    from verl_bpo.core.config import BPOConfig
    from verl_bpo.rollout.sampler import TreeSampler
    from sandbox_adapters.registry import make_sandbox

    draws = load("gradient_draws")
    task = learning.TASKS["hard_late"]
    for name, (root, width) in draws.FIXED_SHAPES.items():
        block = learning.bpo_block(task, "bpo", learning.tree_settings(), draws.fixed_shape(task, root, width))
        sampler = TreeSampler(BPOConfig.from_mapping(block).for_estimator("bpo"), learning.ROLLOUT_N, 512,
                              lambda: make_sandbox(task.sandbox, task.sandbox_config), {"task_id": 0},
                              ScriptedLLM(probs={"east": 1.0}), WordCodec(), tree_id=name)
        leaves = asyncio.run(sampler.run()).leaves
        paths = [leaf.meta.node_path for leaf in leaves]
        assert len(leaves) == learning.ROLLOUT_N and {leaf.meta.leaf_mass for leaf in leaves} == {1 / 8}, name
        assert all(len(p) == 1 + task.sandbox_config["max_steps"] for p in paths), name
        door = task.sandbox_config["length"] - 1  # the node reached after that many turns forks
        assert len({p[door] for p in paths}) == root and len({p[door + 1] for p in paths}) == 8, name
        assert len({p[door - 1] for p in paths}) == root and len({p[1] for p in paths}) == root, name


def synthetic_shapes():
    """A door at depth 3 of 5 that injects all the return variance; RLOO's flat group of 8, and three shapes."""
    fit = load("shape_fit")
    profile = fit.Profile(np.array([0.0, 0.0, 0.0, 0.1, 0.0]), np.full(5, 0.05), np.array([2.0, 2.0, 2.0, 3.0, 1.0]))
    widths = {name: np.array([root, 1, 1, width, 1]) for name, (root, width) in
              {"learned": (4, 5), "r4k2": (4, 2), "r2k4": (2, 4)}.items()}
    return fit, profile, np.array([8, 1, 1, 1, 1]), widths


@pytest.mark.parametrize("correction, value", [("root", 0.15), ("walk", 0.05), ("root", 0.0), ("walk", 0.0)])
def test_shape_fit_recovers_a_correction_from_the_shapes_it_would_measure(correction, value):
    """``benchmarks/shape_fit.py``: measurements made by the model under a correction give that correction's value
    back (the model's own figures give zero, the negative control), every shape within its CI95."""
    fit, profile, flat, widths = synthetic_shapes()
    rows = np.stack(list(widths.values()))
    truth = fit.over_rloo(rows, profile, flat, 3, correction, value)
    measured = {name: (r, r / 1.3, r * 1.3) for name, r in zip(widths, truth)}
    result = fit.fit(correction, measured, widths, profile, flat, 3, fit.GRIDS[correction])
    assert result["value"] == pytest.approx(value, abs=2e-3)
    assert result["ci95"][0] <= result["value"] <= result["ci95"][1] and result["ci95"][1] > result["value"]
    assert result["within_ci95"] and result["error"] < 1e-3
    other = "walk" if correction == "root" else "root"
    if value:  # the other correction cannot fit these figures as well
        assert fit.fit(other, measured, widths, profile, flat, 3, fit.GRIDS[other])["error"] > result["error"]


def test_when_all_noise_sits_at_the_root_no_tree_beats_rloo_per_token():
    """Under the ``root`` correction at b = 1 no shape within RLOO's tokens does better than RLOO's own flat group;
    under the model (b = 0) the door's forks do."""
    fit, profile, flat, _ = synthetic_shapes()
    from verl_bpo.core.shape import candidate_widths
    candidates = candidate_widths(5, 32, 1, 0, 3)
    assert fit.over_rloo(flat[None], profile, flat, 3, "root", 0.4)[0] == pytest.approx(1.0)
    assert fit.best(candidates, profile, flat, 3, "root", 1.0) == {"over_rloo": 1.0, "widths": flat.tolist()}
    model_best = fit.best(candidates, profile, flat, 3)
    assert model_best["over_rloo"] < 0.7 and model_best["widths"][3] > 1  # it forks where the door is


def test_fixed_shapes_refuse_a_task_without_a_door_at_its_last_step():
    draws = load("gradient_draws")
    from verl_bpo.demo.tasks import TASKS
    assert draws.fixed_widths(TASKS["hard_late"], 4, 2).tolist() == [4, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1]
    with pytest.raises(ValueError, match="no door at its last step"):
        draws.fixed_widths(TASKS["hard_early"], 4, 2)


def test_shape_fit_refuses_records_of_two_tasks(tmp_path):
    fit = load("shape_fit")
    fixed, learned = tmp_path / "fixed.json", tmp_path / "learned.json"
    fixed.write_text(json.dumps({"result": {"task": "hard_late", "sets": {}}}))
    learned.write_text(json.dumps({"result": {"task": "real_late"}}))
    with pytest.raises(SystemExit, match="give one task's"):
        fit.measurements(fixed, learned)


def test_shape_fit_reads_the_walks_injected_variance_off_the_trees_variogram():
    """``walk_injected``: the variogram at the root less at the door, with the SE of the trees' spread."""
    fit = load("shape_fit")
    from types import SimpleNamespace
    profile = SimpleNamespace(survival=np.array([1.0, 1.0, 0.5]),
                              variogram=lambda: (np.array([0.2, 0.0, 0.1]), np.array([0.04, 0.0, 0.01]),
                                                 np.array([4.0, 0.0, 1.0])))
    out = fit.walk_injected(profile, 2)
    assert out == {"value": pytest.approx(0.2 - 0.05), "se": pytest.approx(np.sqrt(0.04 / 4 + 0.25 * 0.01), abs=1e-4),
                   "trees": [4.0, 1.0]}
