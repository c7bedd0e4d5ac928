"""Faults that cannot bias: sandbox steps that crash at random are retried, and the production gradient stays the
gradient of the fault-free task.

:class:`FakeFlakyTabularSandbox` (a named fake) is the tabular oracle's sandbox with transient faults injected: a
step crashes with probability ``fault_prob`` *after* the engine moved (so retrying it on the same sandbox would
be wrong), decided by the fake's own random generator, independent of the action and of the engine's draws.
Trees grow through the same production path as tests/test_production_unbiased.py (the ``bpo_tree`` agent loop,
verl's rows, the BPO trainer's estimator context around verl's ``compute_advantage``, verl's policy loss over two
data-parallel ranks, autograd per tree; tests/production.py).

1. **Retried faults leave the gradient unbiased.** At 5% and 20% faults per step, with the default
   ``bpo.step_retries`` (2), mean_i ĝ_i matches the exact ∇J of the *fault-free* MDP: z-test per coordinate within
   the Bonferroni bound (family-wise false alarm 1e-4). A step still fails for good with probability p³
   (1.25e-4 and 0.008 per step), and such a leaf is handled as without retries; the bias this leaves is known
   exactly (∇J of the MDP in which a step fails with p³), and the test checks it is under 1 standard error at the
   trees it runs (measured: 0.01 and 0.43 SE at 4096 trees), so the comparison with the fault-free gradient is fair.
2. **Power: handling without retries is caught.** With ``bpo.step_retries=0`` every fault ends its leaf (failing turn
   masked, earlier turns keep the cut-off return): the gradient is that of a task whose episodes are cut at
   random, which penalises long episodes. At 20% faults, against the fault-free ∇J, it must reach |z| > 6.

Trees per case: ``BPO_FAULT_MC_TREES`` (default 4096: about 30 s per case on 2 idle cores, under 2 minutes for
the file). Power: a coordinate's standard error is σ/√n, so the control's |z| grows as √n. From the exact bias over
the per-coordinate σ (measured at n = 4096), the 20% control's expected max |z| is 0.18·√n = 11.7 at the default
(measured 13.6), 5.7 standard errors past the detection bound of 6: it is missed with probability about 6e-9. The
retried runs measured max |z| 1.3 (5%) and 2.2 (20%) against the bound 4.50. At 5% faults the same control's bias
is 0.042·√n (2.7 at the default), too small to assert at this cost (it would need about 80k trees), so it is not
run; the retried 5% case is.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import ClassVar

import numpy as np
import pytest
from transformers import AutoTokenizer

from sandbox_adapters.base import SandboxCrashed, StepResult
from sandbox_adapters.registry import register_sandbox
from tests.production import Case, bonferroni, run_case, z_scores
from verl_bpo.demo.tiny_model import build_tiny_model
from verl_bpo.oracle.mdp import exact_gradient
from verl_bpo.oracle.sandbox import TabularSandbox

# Three Monte-Carlo cases (minutes on 2 cores): outside the fast tier, whose Monte-Carlo check is the production case
# and its control in tests/test_production_unbiased.py.
pytestmark = pytest.mark.slow

TREES = int(os.environ.get("BPO_FAULT_MC_TREES", "4096"))


@register_sandbox("fake_flaky_tabular")
class FakeFlakyTabularSandbox(TabularSandbox):
    """Fake: the tabular sandbox, whose steps crash at random after the engine moved (transient faults)."""

    @dataclasses.dataclass
    class Config(TabularSandbox.Config):
        """``fault_prob``: probability that a step crashes (after moving the engine), drawn independently."""

        fault_prob: float = 0.0

    seeds: ClassVar[random.Random] = random.Random(0)  # seeds each instance's own fault generator

    def __init__(self, config: FakeFlakyTabularSandbox.Config | None = None) -> None:
        super().__init__(config or FakeFlakyTabularSandbox.Config())
        self._faults = random.Random(FakeFlakyTabularSandbox.seeds.randrange(2**63))

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if self._faults.random() < self.config.fault_prob:
            raise SandboxCrashed("fake: injected transient fault after the step")
        return result


def fault_case(fault_prob: float, step_retries: int | None = None) -> Case:
    """The γ = 1 ``topB_wave`` tree of tests/test_production_unbiased.py (episodes stop at random depths, trees
    under-filled), with transient faults instead of the tabular sandbox's permanent failures."""
    retries = {} if step_retries is None else {"step_retries": step_retries}
    return Case(f"faults-{fault_prob:g}-retries-{step_retries}", "random", {"seed": 1, "stop_prob": 0.4},
                {"mode": "tree", "fixed": {"k": 2, "k0": 2}, "max_turns": 3, **retries}, n=9,
                sandbox="fake_flaky_tabular", sandbox_config={"fault_prob": fault_prob})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def grow(case: Case, tokenizer, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-tree gradients of ``TREES`` trees, the exact ∇J of the fault-free MDP, and the share of failed leaves in
    the first batches."""
    FakeFlakyTabularSandbox.seeds.seed(seed)
    grads, _, batches = run_case(case, tokenizer, TREES, seed=seed)
    failed = [e["bpo"]["failed"] for b in batches for u, e in zip(b.uids, b.extra_fields) if not u.startswith("pad")]
    return grads, case.exact(), float(np.mean(failed))


@pytest.mark.parametrize("fault_prob", [0.05, 0.2])
def test_retried_faults_leave_the_production_gradient_unbiased(fault_prob, tokenizer):
    case = fault_case(fault_prob)
    grads, fault_free, failed = grow(case, tokenizer, seed=5)
    z = z_scores(grads, fault_free)
    bound = bonferroni(z.size)
    # What a step that fails for good (probability p^(1 + retries)) leaves, exactly, in standard errors.
    mdp, theta = case.mdp_theta
    residual = fault_prob ** (1 + case.bpo_config().step_retries)
    flat = grads.reshape(len(grads), -1)
    se = flat.std(axis=0, ddof=1) / np.sqrt(len(flat))
    shift = (exact_gradient(mdp, theta, residual)[1] - fault_free).ravel()
    shift_z = np.abs(shift[se > 0] / se[se > 0]).max()
    print(f"faults {fault_prob:g}: {TREES} trees, failed leaves {failed:.2%}, max |z| = {np.abs(z).max():.2f} "
          f"(bound {bound:.2f}, {z.size} coordinates); residual failures ({residual:.2g} per step) shift the mean "
          f"by {shift_z:.2f} SE at most")
    assert shift_z < 1, (f"the residual failures' bias is {shift_z:.2f} SE at {TREES} trees: the fault-free "
                         "comparison would be unfair (lower BPO_FAULT_MC_TREES or raise this case's step_retries)")
    assert np.abs(z).max() < bound, f"faults {fault_prob:g}: max |z| = {np.abs(z).max():.2f} over {z.size}"


def test_faults_that_end_their_leaf_are_caught(tokenizer):
    """The negative control: no retries (``step_retries=0``, the handling before them) at 20% faults, against
    the fault-free ∇J."""
    grads, fault_free, failed = grow(fault_case(0.2, step_retries=0), tokenizer, seed=6)
    zc = np.abs(z_scores(grads, fault_free)).max()
    print(f"faults 0.2, step_retries=0: {TREES} trees, failed leaves {failed:.1%}, max |z| = {zc:.2f}")
    assert failed > 0.1
    assert zc > 6, f"the bias of faults that end their leaf was not detected: max |z| = {zc:.2f}"
