"""The sampler's sandbox calls: time limits from when a call runs, quarantine of a hung sandbox, a bounded number of
threads however many calls hang, a non-thread-safe engine that no two calls ever enter at once (a hung one
included), and such engines in engine processes, where concurrent trees run in parallel and a hang kills one
process."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest

from sandbox_adapters.alfworld import ALFWorldSandbox, game_walkthrough, resolve_games_dir
from sandbox_adapters.base import Observation, SandboxTimeout
from sandbox_adapters.smoke import SmokeSandbox
from tests.sandboxes.conformance import CharCodec, ScriptedTurns
from verl_bpo.core.config import BPOConfig, FixedAllocation
from verl_bpo.rollout import engine_pool, sandbox_calls
from verl_bpo.rollout.engine_pool import EnginePool
from verl_bpo.rollout.sampler import TreeSampler
from verl_bpo.rollout.sandbox_calls import SandboxCalls, hung_engine

# Time limits and overlap are measured in wall-clock seconds: run alone in the full run (scripts/test.sh).
pytestmark = pytest.mark.timing


class SlowSmoke(SmokeSandbox):
    """The real smoke corridor on worker threads, a step taking ``delay_s``, or blocking until ``release``."""

    blocking = True
    delay_s = 0.0
    release: threading.Event | None = None
    closed = 0

    def _apply(self, action):
        if self.release is not None:
            self.release.wait()
        time.sleep(self.delay_s)
        return super()._apply(action)

    def close(self):
        type(self).closed += 1


class SerialSlowSmoke(SlowSmoke):
    thread_safe = False  # one call of the class at a time, like TextWorld and ALFWorld


class FakeHangingEngine(SlowSmoke):
    """A fake engine whose step blocks until ``release`` is set."""


class FakeSerialEngine(SlowSmoke):
    """A fake non-thread-safe engine that counts the calls inside it at once."""

    thread_safe = False
    guard = threading.Lock()
    inside = most_inside = 0

    def _apply(self, action):
        cls = type(self)
        with cls.guard:
            cls.inside += 1
            cls.most_inside = max(cls.most_inside, cls.inside)
        try:
            return super()._apply(action)
        finally:
            with cls.guard:
                cls.inside -= 1


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # hung threads finish at the end of the test


@pytest.fixture
def small_executor(monkeypatch):
    """A fresh process-wide executor for this test: 4 call threads, at most 8 live ones."""
    monkeypatch.setattr(sandbox_calls, "CALL_THREADS", 4)
    monkeypatch.setattr(sandbox_calls, "MAX_CALL_THREADS", 8)
    monkeypatch.setattr(sandbox_calls, "_EXECUTOR", None)
    yield
    if sandbox_calls._EXECUTOR is not None:
        sandbox_calls._EXECUTOR.shutdown()


def _box(cls, delay_s=0.0, release=None):
    box = cls()
    box.delay_s, box.release = delay_s, release
    box.reset({"task_id": 0})
    return box


def _wait_until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_the_limit_starts_when_the_call_runs_not_while_it_waits_for_the_lock():
    calls = SandboxCalls(timeout_s=0.5)
    first, second = _box(SerialSlowSmoke, 0.4), _box(SerialSlowSmoke, 0.1)

    async def both():
        return await asyncio.gather(calls("step", first, "step", "east"), calls("step", second, "step", "east"))

    start = time.monotonic()
    results = asyncio.run(both())
    # the second call queued ~0.4 s behind the first and ran 0.1 s: 0.5 s after submission, within its own limit
    assert time.monotonic() - start >= 0.5 and len(results) == 2
    assert max(calls.seconds["step"]) < 0.5


def test_a_hung_call_is_quarantined_and_its_sandbox_closed_in_the_background(release):
    calls = SandboxCalls(timeout_s=0.3)
    hung, later = _box(SlowSmoke, release=release), _box(SlowSmoke)

    async def run():
        with pytest.raises(SandboxTimeout) as error:
            await calls("step", hung, "step", "east")
        start = time.monotonic()
        await calls("step", later, "step", "east")  # a thread-safe class: other sandboxes go on at once
        waited = time.monotonic() - start
        with pytest.raises(SandboxTimeout, match="quarantined"):
            await calls("step", hung, "step", "west")  # never called again
        await calls.close(hung)  # returns at once; the close runs on its own thread
        return str(error.value), waited

    SlowSmoke.closed = 0
    message, waited = asyncio.run(run())
    assert waited < 0.3
    assert "SlowSmoke.step ran for 0.3 s" in message and "counted from when it started" in message
    assert "quarantined" in message and "not thread-safe" not in message
    assert _wait_until(lambda: SlowSmoke.closed == 1, 2.0)


def test_a_hung_call_retires_its_non_thread_safe_class_until_it_returns(release):
    """The hung call may still be inside the engine: the call waiting for it and later calls fail at once, and the
    class serves again once the hung call returns."""
    calls = SandboxCalls(timeout_s=0.3)
    hung, queued, later = _box(SerialSlowSmoke, release=release), _box(SerialSlowSmoke), _box(SerialSlowSmoke)

    async def run():
        first = asyncio.ensure_future(calls("step", hung, "step", "east"))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(calls("step", queued, "step", "east"))  # waits for the engine
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        start = time.monotonic()
        with pytest.raises(SandboxTimeout) as late:
            await calls("step", later, "step", "east")
        return [str(o) for o in outcomes], str(late.value), time.monotonic() - start

    (hung_message, queued_message), late_message, took = asyncio.run(run())
    assert "SerialSlowSmoke.step ran for 0.3 s" in hung_message
    assert "waiting for a thread and its engine" in hung_message
    assert "SerialSlowSmoke is not thread-safe" in hung_message and "fail at once until it returns" in hung_message
    for message in (queued_message, late_message):
        assert message.startswith("SerialSlowSmoke.step was not called: SerialSlowSmoke is not thread-safe")
        assert "an earlier call, SerialSlowSmoke.step, ran past bpo.step_timeout_s=0.3" in message
    assert took < 0.1
    assert hung_engine(SerialSlowSmoke) == "SerialSlowSmoke.step"
    release.set()
    assert _wait_until(lambda: hung_engine(SerialSlowSmoke) is None)
    result = asyncio.run(calls("step", later, "step", "east"))
    assert not result.done and result.observation.text


def test_fifty_hung_calls_leave_a_bounded_number_of_threads(release, small_executor):
    """Each hung call loses its thread; replacements stop at the cap, after which calls fail at once instead of
    queueing forever; once the hung calls return, calls run again on no more than CALL_THREADS threads."""
    calls = SandboxCalls(timeout_s=0.2)
    hung = [_box(FakeHangingEngine, release=release) for _ in range(50)]
    baseline = threading.active_count()

    async def run():
        start = time.monotonic()
        outcomes = await asyncio.gather(*(calls("step", box, "step", "east") for box in hung), return_exceptions=True)
        took = time.monotonic() - start
        extra = threading.active_count() - baseline
        later = await asyncio.gather(calls("step", _box(FakeHangingEngine), "step", "east"), return_exceptions=True)
        return outcomes, took, extra, later[0]

    outcomes, took, extra, later = asyncio.run(run())
    assert extra <= 8, f"{extra} threads for 50 hung calls"
    assert all(isinstance(o, SandboxTimeout) for o in outcomes)
    assert sum("ran for 0.2 s" in str(o) for o in outcomes) == 8  # 4 threads, then 4 replacements: the cap
    stranded = [str(o) for o in outcomes if "was not called" in str(o)]
    assert len(stranded) == 42 and all("MAX_CALL_THREADS=8" in m for m in stranded)
    assert took < 3.0  # two rounds of hung calls, then the rest fail at once
    assert isinstance(later, SandboxTimeout) and "no thread is left to run it" in str(later)
    release.set()
    executor = sandbox_calls._EXECUTOR
    assert _wait_until(lambda: executor.counts()["lost"] == 0 and executor.counts()["live"] <= 4)
    result = asyncio.run(SandboxCalls(1.0)("step", _box(FakeHangingEngine), "step", "east"))
    assert not result.done and executor.counts()["live"] <= 4


def test_a_non_thread_safe_engine_is_never_entered_by_two_calls(release, small_executor):
    """Fifty calls of a fake non-thread-safe engine that all hang: one enters, the others fail once it hangs;
    after it returns the class serves again, still one call at a time."""
    FakeSerialEngine.inside = FakeSerialEngine.most_inside = 0
    calls = SandboxCalls(timeout_s=0.2)
    hung = [_box(FakeSerialEngine, release=release) for _ in range(50)]

    async def gather(boxes):
        return await asyncio.gather(*(calls("step", box, "step", "east") for box in boxes), return_exceptions=True)

    start = time.monotonic()
    outcomes = asyncio.run(gather(hung))
    took = time.monotonic() - start
    assert FakeSerialEngine.most_inside == 1
    assert all(isinstance(o, SandboxTimeout) for o in outcomes)
    assert sum("ran for 0.2 s" in str(o) for o in outcomes) == 1
    assert sum("was not called: FakeSerialEngine is not thread-safe" in str(o) for o in outcomes) == 49
    assert took < 2.0  # the 49 fail when the first hangs, not each after a limit of its own
    release.set()
    assert _wait_until(lambda: hung_engine(FakeSerialEngine) is None)
    results = asyncio.run(gather([_box(FakeSerialEngine, delay_s=0.01) for _ in range(10)]))
    assert not any(isinstance(r, BaseException) for r in results)
    assert FakeSerialEngine.most_inside == 1


def test_a_cancelled_call_frees_its_place_at_the_engine():
    calls = SandboxCalls(timeout_s=2.0)
    slow, waiting, after = _box(SerialSlowSmoke, 0.3), _box(SerialSlowSmoke), _box(SerialSlowSmoke)

    async def run():
        first = asyncio.ensure_future(calls("step", slow, "step", "east"))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(calls("step", waiting, "step", "east"))  # waits for the engine
        await asyncio.sleep(0.05)
        second.cancel()
        await first
        return await asyncio.wait_for(calls("step", after, "step", "east"), 1.0)

    assert not asyncio.run(run()).done


def test_an_exception_in_the_engine_reaches_the_caller():
    class Broken(SlowSmoke):
        def _apply(self, action):
            raise ZeroDivisionError("engine bug")

    with pytest.raises(ZeroDivisionError):
        asyncio.run(SandboxCalls(1.0)("step", _box(Broken), "step", "east"))


# --- engines in processes of their own ---------------------------------------------------------------------------


class FakeProcessEngine(SmokeSandbox):
    """A fake non-thread-safe engine that runs in engine processes: each step sleeps ``step_s`` and reports the
    process it ran in; a sandbox with ``hang_at`` set never returns from that step."""

    blocking = True
    thread_safe = False
    engine_process = True
    step_s = 0.05
    hang_at: int | None = None

    def _apply(self, action):
        if self.hang_at is not None and self._state.steps >= self.hang_at:
            time.sleep(3600)
        time.sleep(self.step_s)
        result = super()._apply(action)
        info = {**result.info, "pid": os.getpid()}
        return dataclasses.replace(result, observation=Observation(result.observation.text, info), info=info)


@pytest.fixture
def engines(monkeypatch):
    """A pool of three engine processes, the process's shared one for this test."""
    pool = EnginePool(3)
    monkeypatch.setattr(engine_pool, "_SHARED", pool)
    yield pool
    pool.shutdown()


def _grow(trees, make, task=None, turns=("look",), **config):
    """Grow ``trees`` trees at once on one event loop (one agent-loop worker); their results and the wall time."""
    config = BPOConfig(mode="tree", fixed=FixedAllocation(k=2, k0=2), **{"max_turns": 4, "step_timeout_s": 10.0,
                                                                          **config})

    async def run():
        samplers = [TreeSampler(config, 4, 1 << 20, make, task or {"task_id": 0}, ScriptedTurns(list(turns)),
                                CharCodec(), tree_id=f"t{i}", seed=i) for i in range(trees)]
        return await asyncio.gather(*(s.run() for s in samplers))

    start = time.monotonic()
    results = asyncio.run(run())
    return results, time.monotonic() - start


# `slow` (outside the fast tier): the tests that start engine processes; the fast tier keeps the one that stays in
# this process.
@pytest.mark.slow
def test_concurrent_trees_of_a_non_thread_safe_engine_run_in_parallel_in_engine_processes(engines):
    _grow(3, FakeProcessEngine)  # starts the three processes and imports the engine in each
    (alone,), one = _grow(1, FakeProcessEngine)
    together, three = _grow(3, FakeProcessEngine)
    for result in (alone, *together):
        assert len(result.leaves) == 4 and not any(leaf.failed for leaf in result.leaves)
    assert three <= 1.3 * one, f"three trees took {three:.2f} s, one alone {one:.2f} s"
    assert alone.metrics["bpo/sandbox_s"] >= 0.05 * 8  # the steps did sleep: the trees had work to overlap


@pytest.mark.slow
def test_a_tree_lives_in_one_engine_process_and_trees_spread_over_them(engines):
    async def run():
        calls = [SandboxCalls(5.0) for _ in range(3)]
        roots = [FakeProcessEngine() for _ in calls]
        for c, root in zip(calls, roots):
            await c("reset", root, "reset", {"task_id": 0})
        snaps = [await c("snapshot", root, "snapshot") for c, root in zip(calls, roots)]
        children = [FakeProcessEngine() for _ in calls]
        for c, child, snap in zip(calls, children, snaps):
            await c("restore", child, "restore", snap, 1)
            snap.close()
        steps = [await c("step", box, "step", "look") for c, pair in zip(calls, zip(roots, children)) for box in pair]
        for c, pair in zip(calls, zip(roots, children)):
            for box in pair:
                await c.close(box)
        return [r.info["pid"] for r in steps]

    pids = asyncio.run(run())
    assert len(set(pids)) == 3 and pids[0::2] == pids[1::2]  # each root with its child, each tree in its own
    assert os.getpid() not in pids


@pytest.mark.slow
def test_a_hung_call_in_an_engine_process_kills_it_and_the_next_tree_proceeds(engines):
    made = []

    def hanging_root():
        box = FakeProcessEngine()
        if not made:
            box.hang_at = 1  # the root's second step never returns (after the root fork)
        made.append(box)
        return box

    _grow(1, FakeProcessEngine)  # starts a process, so that the timing below is the hung tree's alone
    # step_retries=0: the hung step ends its leaf at once (a retry from a snapshot would need the killed process)
    (hung,), took = _grow(1, hanging_root, step_timeout_s=1.0, step_retries=0)
    errors = [leaf.error for leaf in hung.leaves]
    assert all(leaf.failed for leaf in hung.leaves), errors  # the whole tree lived in the killed process
    assert sum("ran for 1 s" in e and "was killed with the call" in e for e in errors) == 1, errors
    assert sum("was stopped: FakeProcessEngine.step ran past" in e for e in errors) >= 1, errors
    assert took < 30.0  # the hung call sleeps for an hour: the tree did not wait for it
    (after,), _ = _grow(1, FakeProcessEngine)
    assert not any(leaf.failed for leaf in after.leaves), [leaf.error for leaf in after.leaves]


class FileWritingEngine(FakeProcessEngine):
    """A fake engine whose every step writes a file where its process runs (as a Z-machine's "save" does)."""

    def _apply(self, action):
        result = super()._apply(action)
        with open("written", "w") as f:
            f.write(action)
        info = {**result.info, "cwd": os.getcwd()}
        return dataclasses.replace(result, observation=Observation(result.observation.text, info), info=info)


def _gone(path: str, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


@pytest.mark.slow
def test_an_engine_process_writes_only_in_a_private_directory_that_ends_with_it(engines, tmp_path, monkeypatch):
    """A file the engine writes lands in its process's own directory, never where the trainer runs, and that
    directory is removed when the process ends: shut down, or killed for a call past its limit."""
    monkeypatch.chdir(tmp_path)  # where the trainer runs
    calls = SandboxCalls(5.0)

    async def step(box):
        await calls("reset", box, "reset", {"task_id": 0})
        return (await calls("step", box, "step", "look")).info["cwd"]

    killed, shut = FileWritingEngine(), FileWritingEngine()
    dirs = [asyncio.run(step(box)) for box in (killed, shut)]
    for workdir in dirs:
        assert os.path.basename(workdir).startswith(engine_pool.WORKDIR_PREFIX) and os.path.isdir(workdir)
        assert (Path(workdir) / "written").read_text() == "look"
    assert not (tmp_path / "written").exists() and dirs[0] != dirs[1]  # two trees, two processes
    engines.stop(killed, "step", 1.0)
    assert _gone(dirs[0]), "a killed engine process's directory outlived it"
    engines.shutdown()
    assert _gone(dirs[1]), "a shut-down engine process's directory outlived it"


def test_a_sandbox_that_does_not_pickle_runs_in_this_process(engines):
    box = FakeProcessEngine()
    box.lock = threading.Lock()  # does not pickle
    calls = SandboxCalls(5.0)

    async def run():
        await calls("reset", box, "reset", {"task_id": 0})
        return await calls("step", box, "step", "look")

    assert asyncio.run(run()).info["pid"] == os.getpid() and not engines.bound(box)


class TimedALFWorld(ALFWorldSandbox):
    """The real ALFWorld, noting when each step ran and in which process (a line appended to the file ``spans``)."""

    spans: str | None = None

    def step(self, action_text):
        start = time.time()
        try:
            return super().step(action_text)
        finally:
            if self.spans:
                with open(self.spans, "a") as f:
                    f.write(f"{os.getpid()} {start} {time.time()}\n")


@pytest.fixture(scope="module")
def alf_game(tmp_path_factory):
    """One pick-and-place game made by the real alfworld-generate (~5 s), and its expert plan."""
    pytest.importorskip("alfworld", reason="alfworld is not installed (pip install -e .[envs])")
    pytest.importorskip("fast_downward", reason="fast-downward-textworld is not installed (pip install -e .[envs])")
    from sandbox_adapters.alfworld.gen import TASK_TYPES, find_games, generate_games, write_problems

    root = tmp_path_factory.mktemp("alfworld_data")
    write_problems(root, seeds=[0], task_types=TASK_TYPES[:1])
    generate_games(root / "json_2.1.1")
    game = str(find_games(resolve_games_dir(root, "train"))[0])
    return game, game_walkthrough(game)


def _grow_alfworld(trees, alf_game, spans=None):
    """``trees`` concurrent trees of 4 leaves, each leaf playing "look" and then the expert plan."""
    game, plan = alf_game

    def make():
        box = TimedALFWorld()
        box.spans = spans
        return box

    return _grow(trees, make, {"game": game}, ["look", *plan], max_turns=len(plan) + 1, step_timeout_s=60.0)


@pytest.mark.slow
@pytest.mark.envs
def test_alfworld_trees_of_one_worker_step_in_parallel_in_engine_processes(engines, alf_game, tmp_path):
    """Steps of two concurrent ALFWorld trees run in two engine processes at the same time (under one lock per
    class they never overlap), and every leaf plays the expert plan to the win."""
    spans = tmp_path / "spans"
    _grow_alfworld(2, alf_game)  # starts the processes and loads the engine in each
    results, _ = _grow_alfworld(2, alf_game, str(spans))
    assert all(leaf.reward == 1.0 and not leaf.failed for result in results for leaf in result.leaves)
    by_pid = {}
    for line in spans.read_text().split("\n"):
        if line:
            pid, start, end = line.split()
            by_pid.setdefault(int(pid), []).append((float(start), float(end)))
    assert len(by_pid) == 2 and os.getpid() not in by_pid
    first, second = by_pid.values()
    assert any(a < d and c < b for a, b in first for c, d in second), "no two steps of the two trees overlapped"


@pytest.mark.slow
@pytest.mark.envs
def test_alfworld_concurrent_trees_take_at_most_1_3x_one_tree(engines, alf_game):
    cpus = len(os.sched_getaffinity(0))
    if cpus < 4:
        pytest.skip(f"timing three CPU-bound engine processes and the sampler needs 4 CPUs; this machine has {cpus}")
    _grow_alfworld(3, alf_game)  # starts the processes and loads the engine in each
    _, one = _grow_alfworld(1, alf_game)
    _, three = _grow_alfworld(3, alf_game)
    assert three <= 1.3 * one, f"three ALFWorld trees took {three:.2f} s, one alone {one:.2f} s"
