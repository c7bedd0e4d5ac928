"""Reusable conformance tests for every :class:`sandbox_adapters.base.Sandbox` adapter.

Subclass :class:`SandboxConformance` in a module named ``test_*.py`` with a class named ``Test...`` and fill in the
hooks; pytest then runs every ``test_*`` method below against the adapter::

    from tests.sandboxes.conformance import SandboxConformance

    class TestMySandbox(SandboxConformance):
        def make_sandbox(self):
            return MySandbox(MySandbox.Config())

        def task(self):
            return {"task_id": 0}

        def prefix_actions(self):
            return ["go north"]          # reaches a decision point; the episode must not end here

        def probe_actions(self):
            return ["open door", "go east"]

        def other_action(self):
            return "go south"            # differs from probe_actions()[0] in its next observation

Hooks that need a running engine may use pytest fixtures: declare an ``autouse`` fixture method in the subclass
that stores what the hooks need on ``self`` (pytest builds one instance per test).

The checks are the contract of ``sandbox_adapters/base.py``:

* restore + the same actions == replay from reset (observation text, reward, done), into a fresh sandbox;
* different actions after a restore fork independently (two children, and one sandbox restored twice);
* restoring never mutates the parent: it continues identically after its children ran;
* a snapshot survives many restores, and restoring with the same seed twice gives the same continuation;
* ``close()`` leaves no child process, mount or temporary directory behind (checked in a private temp dir that
  ``tempfile`` and ``$TMPDIR`` point to during the test, so concurrent processes do not disturb the count);
* model text without a parseable action is an observation with ``info["invalid_action"]``, never an exception;
* a snapshot taken after the episode ended restores into an ended episode (no second reward);
* faults: a step that raises -> ``SandboxCrashed``, a corrupted snapshot -> ``RestoreFailed`` (and the sandbox
  still works afterwards), and a hang: a tree grown by the production ``TreeSampler`` whose root sandbox's engine
  never returns from a step ends that leaf with ``SandboxTimeout`` while its sibling finishes, and the next tree
  on the same engine class grows normally (no lock or thread stays held by the hung call).

Replay-based checks only hold for ``deterministic = True`` adapters; for stochastic ones they are skipped and the
same-seed check stands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from sandbox_adapters.base import (
    RestoreFailed,
    Sandbox,
    SandboxCrashed,
    Snapshot,
    SnapshotKind,
    StepResult,
)

__all__ = ["SandboxConformance", "transcript", "resource_counts", "ScriptedTurns", "CharCodec"]


def transcript(results: Sequence[StepResult]) -> list[tuple[str, float, bool]]:
    """The comparable part of a run: observation text, reward and done of each step."""
    return [(r.observation.text, float(r.reward), bool(r.done)) for r in results]


def _child_pids() -> set[int]:
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as f:
            pids.update(int(p) for p in f.read().split())
    return pids


def resource_counts(tmp_dir: str | None = None) -> dict[str, Any]:
    """What a sandbox may leak: child processes (by pid), mount lines, entries of the temp dir (by name)."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    with open("/proc/mounts") as f:
        mounts = set(f.read().splitlines())
    return {"children": _child_pids(), "mounts": mounts, "tmp": set(os.listdir(tmp_dir))}


@dataclasses.dataclass
class _Generation:
    token_ids: list[int]
    log_probs: list[float]


class ScriptedTurns:
    """A FAKE LLM client for the sampler: turn ``t`` of every branch is ``turns[t]`` (the last one repeats).

    Tokens are Unicode code points and every turn ends with token 0, so the turn index is the number of zeros in
    the prompt (observations never contain NUL)."""

    def __init__(self, turns: Sequence[str]) -> None:
        self.turns = list(turns)

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        turn = self.turns[min(list(prompt_ids).count(0), len(self.turns) - 1)]
        ids = [ord(c) for c in turn] + [0]
        return _Generation(ids, [-0.1] * len(ids))


class CharCodec:
    """A FAKE tokenizer for :class:`ScriptedTurns`: one token per code point; environment text has mask 0."""

    async def start(self, messages):
        return [ord(c) for m in messages for c in m["content"] if c != "\0"]

    async def add_assistant(self, transcript, token_ids, log_probs):
        transcript.token_ids += token_ids
        transcript.response_mask += [1] * len(token_ids)
        transcript.response_logprobs += list(log_probs)
        text = "".join(chr(t) for t in token_ids if t)
        transcript.messages.append({"role": "assistant", "content": text})
        return text

    async def add_user(self, transcript, text):
        ids = [ord(c) for c in text if c != "\0"] or [32]
        transcript.token_ids += ids
        transcript.response_mask += [0] * len(ids)
        transcript.response_logprobs += [0.0] * len(ids)
        transcript.messages.append({"role": "user", "content": text})


class SandboxConformance:
    """Base class of the per-adapter conformance suites; see the module docstring for the hooks."""

    #: How many times ``test_snapshot_survives_many_restores`` restores one snapshot.
    many_restores: int = 5
    #: ``bpo.step_timeout_s`` of the sampler in the hang test: longer than any normal call of the adapter.
    sampler_step_timeout_s: float = 3.0

    # --- hooks every adapter provides -----------------------------------------------------------------------
    def make_sandbox(self) -> Sandbox:
        """A new, not yet reset sandbox of the adapter under test."""
        raise NotImplementedError

    def task(self) -> Mapping[str, Any]:
        """A task to reset with."""
        raise NotImplementedError

    def prefix_actions(self) -> Sequence[str]:
        """Raw model turns that lead from reset to a decision point without ending the episode."""
        raise NotImplementedError

    def probe_actions(self) -> Sequence[str]:
        """Turns played after the decision point (at least one; the episode may end on the last)."""
        raise NotImplementedError

    def other_action(self) -> str:
        """A turn whose observation after the decision point differs from that of ``probe_actions()[0]``."""
        raise NotImplementedError

    # --- optional hooks -------------------------------------------------------------------------------------
    def invalid_texts(self) -> Sequence[str]:
        """Model turns that contain no parseable action."""
        return ["", "   \n  ", "I am not sure what to do here."]

    def inject_step_crash(self, sandbox: Sandbox) -> None:
        """Arrange that the next ``sandbox.step`` fails inside the engine (e.g. monkeypatch it to raise)."""
        pytest.skip(f"{type(self).__name__} does not inject step crashes")

    def inject_step_hang(self, sandbox: Sandbox, release: threading.Event) -> None:
        """Arrange that the next ``sandbox.step`` blocks inside the engine until ``release`` is set (a call that
        never returns, as a wedged engine, daemon or container runtime would). The default blocks the engine hook
        ``_apply`` of this one instance."""
        apply = sandbox._apply

        def hanging(action: str) -> StepResult:
            release.wait()
            return apply(action)

        sandbox._apply = hanging  # type: ignore[method-assign]

    def corrupt_snapshot(self, snapshot: Snapshot) -> Snapshot:
        """A copy of ``snapshot`` that the adapter cannot restore. The default garbles a non-replay payload."""
        if snapshot.kind is SnapshotKind.REPLAY:
            pytest.skip("replay snapshots carry no payload to corrupt; override corrupt_snapshot")
        return dataclasses.replace(snapshot, payload=b"\x00corrupted payload\x00", release=None)

    # --- helpers --------------------------------------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _close_opened_sandboxes(self) -> Iterator[None]:
        self._opened: list[Sandbox] = []
        self._snapshots: list[Snapshot] = []
        yield
        for snap in self._snapshots:
            snap.close()
        for sandbox in self._opened:
            sandbox.close()

    def open(self) -> Sandbox:
        """``make_sandbox()``, closed automatically at the end of the test."""
        sandbox = self.make_sandbox()
        self._opened.append(sandbox)
        return sandbox

    def at_decision_point(self) -> tuple[Sandbox, Snapshot]:
        """A sandbox that played ``prefix_actions()``, and a snapshot of it."""
        sandbox = self.open()
        sandbox.reset(self.task())
        for text in self.prefix_actions():
            result = sandbox.step(text)
            assert not result.done, f"prefix action {text!r} ended the episode; choose a shorter prefix"
        snap = sandbox.snapshot()
        self._snapshots.append(snap)
        return sandbox, snap

    def replay(self, actions: Sequence[str]) -> list[StepResult]:
        """Results of ``prefix_actions()`` then ``actions`` from a fresh reset; returns those of ``actions``."""
        sandbox = self.open()
        sandbox.reset(self.task())
        for text in self.prefix_actions():
            sandbox.step(text)
        return self.play(sandbox, actions)

    @staticmethod
    def play(sandbox: Sandbox, actions: Sequence[str]) -> list[StepResult]:
        """Step through ``actions``, stopping early when the episode ends."""
        results = []
        for text in actions:
            results.append(sandbox.step(text))
            if results[-1].done:
                break
        return results

    @staticmethod
    def require_deterministic(sandbox: Sandbox) -> None:
        if not sandbox.deterministic:
            pytest.skip(f"{type(sandbox).__name__} is stochastic; replay equality does not apply")

    # --- the contract ---------------------------------------------------------------------------------------
    def test_hooks_are_consistent(self) -> None:
        assert len(self.probe_actions()) >= 1
        assert self.other_action() != self.probe_actions()[0]

    def test_reset_gives_text_and_prompts(self) -> None:
        sandbox = self.open()
        obs = sandbox.reset(self.task())
        assert isinstance(obs.text, str) and obs.text.strip()
        assert sandbox.system_prompt().strip()
        assert sandbox.first_user_message(obs).strip()
        assert isinstance(sandbox.render_observation(obs), str)

    def test_restore_then_same_actions_equals_replay(self) -> None:
        parent, snap = self.at_decision_point()
        self.require_deterministic(parent)
        child = self.open()  # a fresh sandbox that was never reset
        child.restore(snap)
        assert child.actions == tuple(self.prefix_actions())
        forked = transcript(self.play(child, self.probe_actions()))
        assert forked == transcript(self.replay(self.probe_actions()))

    def test_different_actions_fork_independently(self) -> None:
        parent, snap = self.at_decision_point()
        self.require_deterministic(parent)
        a, b = self.open(), self.open()
        a.restore(snap)
        b.restore(snap)
        first_a = a.step(self.probe_actions()[0])
        first_b = b.step(self.other_action())
        assert first_a.observation.text != first_b.observation.text, "other_action() must lead elsewhere"
        # b's moves must not have leaked into a: a continues like a replay of the probe actions.
        rest_a = self.play(a, self.probe_actions()[1:]) if not first_a.done else []
        assert transcript([first_a, *rest_a]) == transcript(self.replay(self.probe_actions()))
        assert first_b.observation.text == self.replay([self.other_action()])[0].observation.text

    def test_same_sandbox_restored_twice_forks_independently(self) -> None:
        parent, snap = self.at_decision_point()
        self.require_deterministic(parent)
        child = self.open()
        child.restore(snap)
        child.step(self.other_action())
        child.restore(snap)  # back to the decision point, forgetting the other branch
        assert child.actions == tuple(self.prefix_actions())
        assert transcript(self.play(child, self.probe_actions())) == transcript(self.replay(self.probe_actions()))

    def test_restoring_never_mutates_parent(self) -> None:
        parent, snap = self.at_decision_point()
        self.require_deterministic(parent)
        actions_before = snap.actions
        for action in (self.other_action(), self.probe_actions()[0]):
            child = self.open()
            child.restore(snap)
            self.play(child, [action, *self.probe_actions()])
        assert snap.actions == actions_before
        assert parent.actions == tuple(self.prefix_actions())
        assert transcript(self.play(parent, self.probe_actions())) == transcript(self.replay(self.probe_actions()))

    def test_restore_into_the_parent_itself(self) -> None:
        parent, snap = self.at_decision_point()
        self.require_deterministic(parent)
        self.play(parent, [self.other_action()])
        parent.restore(snap)
        assert transcript(self.play(parent, self.probe_actions())) == transcript(self.replay(self.probe_actions()))

    def test_snapshot_survives_many_restores(self) -> None:
        _, snap = self.at_decision_point()
        child = self.open()
        runs = []
        for i in range(self.many_restores):
            child.restore(snap, seed=1234)
            runs.append(transcript(self.play(child, self.probe_actions())))
            # a different branch between restores must not wear the snapshot down
            child.restore(snap, seed=i)
            self.play(child, [self.other_action()])
        assert all(run == runs[0] for run in runs), runs

    def test_same_seed_same_continuation(self) -> None:
        _, snap = self.at_decision_point()
        a, b = self.open(), self.open()
        a.restore(snap, seed=7)
        b.restore(snap, seed=7)
        assert transcript(self.play(a, self.probe_actions())) == transcript(self.play(b, self.probe_actions()))

    def test_close_leaves_nothing_behind(self, monkeypatch) -> None:
        # Other processes (parallel test runs) create mounts and temp entries too, so the sandbox gets a private
        # temp dir: whatever it leaves there, or any new mount naming it, is its own leak.
        private_tmp = tempfile.mkdtemp(prefix="bpo-conformance-")
        monkeypatch.setattr(tempfile, "tempdir", private_tmp)
        monkeypatch.setenv("TMPDIR", private_tmp)
        try:
            before = resource_counts(private_tmp)
            sandbox = self.make_sandbox()
            sandbox.reset(self.task())
            for text in self.prefix_actions():
                sandbox.step(text)
            snap = sandbox.snapshot()
            child = self.make_sandbox()
            child.restore(snap)
            self.play(child, self.probe_actions())
            snap.close()
            child.close()
            sandbox.close()
            sandbox.close()  # closing twice is allowed
            # a process may take a moment to be reaped after it was killed
            deadline = time.monotonic() + 5.0
            while True:
                after = resource_counts(private_tmp)
                leaked_children = after["children"] - before["children"]
                if not leaked_children or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert not leaked_children, f"child processes left behind: {sorted(leaked_children)}"
            leaked_mounts = [m for m in after["mounts"] - before["mounts"] if private_tmp in m]
            assert not leaked_mounts, f"mounts left behind: {leaked_mounts}"
            assert not after["tmp"], f"temporary entries left behind: {sorted(after['tmp'])}"
        finally:
            shutil.rmtree(private_tmp, ignore_errors=True)

    def test_invalid_text_is_an_observation(self) -> None:
        sandbox = self.open()
        sandbox.reset(self.task())
        for text in self.invalid_texts():
            result = sandbox.step(text)
            assert result.info.get("invalid_action"), f"{text!r} was not flagged invalid: {result!r}"
            assert result.reward == 0.0
            assert not result.done
            assert result.observation.text.strip()
        # the sandbox still works after invalid turns
        for text in self.prefix_actions():
            assert not sandbox.step(text).info.get("invalid_action")

    def test_invalid_text_keeps_replay_exact(self) -> None:
        sandbox = self.open()
        self.require_deterministic(sandbox)
        sandbox.reset(self.task())
        sandbox.step(self.invalid_texts()[-1])
        for text in self.prefix_actions():
            sandbox.step(text)
        snap = sandbox.snapshot()
        self._snapshots.append(snap)
        child = self.open()
        child.restore(snap)
        assert transcript(self.play(child, self.probe_actions())) == transcript(
            self.play(sandbox, self.probe_actions())
        )

    # --- faults ---------------------------------------------------------------------------------------------
    def test_step_crash_raises_sandbox_crashed(self) -> None:
        sandbox, _ = self.at_decision_point()
        self.inject_step_crash(sandbox)
        with pytest.raises(SandboxCrashed):
            sandbox.step(self.probe_actions()[0])

    # timing: its step limit is a wall-clock bound (beside the full run's verl runs, a healthy SWE submit, grading in a
    # fresh sandbox, once passed 10 s on both leaves of a tree)
    @pytest.mark.timing
    def test_hang_fails_the_leaf_and_the_next_tree_proceeds(self) -> None:
        from verl_bpo.core.config import BPOConfig, FixedAllocation
        from verl_bpo.rollout.sampler import TreeSampler
        from verl_bpo.rollout.sandbox_calls import hung_engine

        probe = self.make_sandbox()
        blocking = type(probe).blocking
        probe.close()
        if not blocking:
            pytest.skip("blocking = False: the adapter's calls run on the event loop and cannot hang by contract")
        turns = [*self.prefix_actions(), *self.probe_actions()]
        # step_retries=0: the hung step ends its leaf at once (a retry would rebuild it on a sandbox that does not hang)
        config = BPOConfig(mode="tree", max_turns=len(turns), step_timeout_s=self.sampler_step_timeout_s,
                           step_retries=0, fixed=FixedAllocation(k=2, k0=2))
        release = threading.Event()
        made: list[Sandbox] = []

        def make(hang_first: bool) -> Sandbox:
            sandbox = self.make_sandbox()
            made.append(sandbox)
            if hang_first and len(made) == 1:  # the root: its first step never returns
                self.inject_step_hang(sandbox, release)
            return sandbox

        def grow(hang_first: bool, tree_id: str):
            sampler = TreeSampler(config, 2, 1 << 22, lambda: make(hang_first), self.task(),
                                  ScriptedTurns(turns), CharCodec(), tree_id=tree_id, seed=1)
            budget = self.sampler_step_timeout_s * (len(turns) + 4) + 60
            return asyncio.run(asyncio.wait_for(sampler.run(), budget))

        cls = type(probe)
        try:
            hung = grow(True, "hung-tree")
            if not cls.thread_safe and not getattr(cls, "engine_process", False):
                # the class stays retired in this process until the hung call returns (see sandbox_calls)
                release.set()
                deadline = time.monotonic() + 30
                while hung_engine(cls) is not None and time.monotonic() < deadline:
                    time.sleep(0.05)
            made.clear()
            start = time.monotonic()
            after = grow(False, "next-tree")
            took = time.monotonic() - start
        finally:
            release.set()
            # The hung call's thread closes what was left to it as it returns: let it finish before anything else
            # enters the engine (the next test calls it directly).
            deadline = time.monotonic() + 30
            while hung_engine(cls) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            for sandbox in made:
                sandbox.close()
        errors = [leaf.error for leaf in hung.leaves]
        failed = [leaf.error for leaf in hung.leaves if leaf.failed]
        assert len(hung.leaves) == 2 and sum("SandboxTimeout" in e and "ran for" in e for e in failed) == 1, errors
        if cls.thread_safe:
            assert len(failed) == 1, errors
        else:
            # The hung call may still be inside engine state the whole process shares, and the root runs in this
            # process (an injected hang does not pickle), as does its sibling, restored from the root's snapshot:
            # the sibling fails at once rather than enter the engine beside the hung call.
            assert len(failed) == 2 and all("not thread-safe" in e for e in failed), errors
        assert not any(leaf.failed for leaf in after.leaves), [leaf.error for leaf in after.leaves]
        assert took < self.sampler_step_timeout_s * len(turns), f"the next tree took {took:.1f} s"

    def test_restoring_an_ended_episode_keeps_it_ended(self) -> None:
        sandbox, _ = self.at_decision_point()
        results = self.play(sandbox, self.probe_actions())
        if not results[-1].done:
            pytest.skip("probe_actions() do not end the episode")
        ended = sandbox.snapshot()
        self._snapshots.append(ended)
        assert ended.done
        for target in (self.open(), sandbox):  # a fresh sandbox, and the one that played the episode
            target.restore(ended, seed=3)
            assert target.done
            with pytest.raises(RuntimeError, match="after the episode ended"):
                target.step(self.probe_actions()[-1])

    def test_corrupt_snapshot_raises_restore_failed(self) -> None:
        parent, snap = self.at_decision_point()
        bad = self.corrupt_snapshot(snap)
        child = self.open()
        with pytest.raises(RestoreFailed):
            child.restore(bad)
        # the sandbox is usable again once restored from a good snapshot
        child.restore(snap)
        assert child.actions == tuple(self.prefix_actions())
        results = self.play(child, self.probe_actions())
        if parent.deterministic:
            assert transcript(results) == transcript(self.replay(self.probe_actions()))
