"""The sampler's sandbox calls: time limits from when a call runs, quarantine of a hung sandbox, fresh locks,
and hung calls that hold nothing later calls need."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sandbox_adapters.base import SandboxTimeout
from sandbox_adapters.smoke import SmokeSandbox
from verl_bpo.rollout.sandbox_calls import SandboxCalls


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


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # hung threads finish at the end of the test


def _box(cls, delay_s=0.0, release=None):
    box = cls()
    box.delay_s, box.release = delay_s, release
    box.reset({"task_id": 0})
    return box


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


def test_a_hung_call_is_quarantined_and_frees_the_engine_lock(release):
    calls = SandboxCalls(timeout_s=0.3)
    hung, later = _box(SerialSlowSmoke, release=release), _box(SerialSlowSmoke)

    async def run():
        with pytest.raises(SandboxTimeout) as error:
            await calls("step", hung, "step", "east")
        start = time.monotonic()
        await calls("step", later, "step", "east")  # same engine class: needs the lock the hung call holds
        waited = time.monotonic() - start
        with pytest.raises(SandboxTimeout, match="quarantined"):
            await calls("step", hung, "step", "west")  # never called again
        await calls.close(hung)  # returns at once; the close runs on its own thread
        return str(error.value), waited

    SerialSlowSmoke.closed = 0
    message, waited = asyncio.run(run())
    assert waited < 0.3
    assert "SerialSlowSmoke.step ran for 0.3 s" in message and "counted from when it started" in message
    assert "waiting for its engine lock" in message and "fresh engine lock" in message and "quarantined" in message
    deadline = time.monotonic() + 2
    while SerialSlowSmoke.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert SerialSlowSmoke.closed == 1


def test_many_hung_calls_hold_no_thread_that_later_calls_need(release):
    """Hung calls keep only their own threads: a fixed pool of workers would be exhausted by them."""
    calls = SandboxCalls(timeout_s=0.2)
    hung = [_box(SlowSmoke, release=release) for _ in range(200)]

    async def run():
        outcomes = await asyncio.gather(*(calls("step", box, "step", "east") for box in hung), return_exceptions=True)
        assert all(isinstance(o, SandboxTimeout) for o in outcomes)
        return await asyncio.wait_for(calls("step", _box(SlowSmoke), "step", "east"), 5.0)

    result = asyncio.run(run())
    assert not result.done and result.observation.text


def test_an_exception_in_the_engine_reaches_the_caller():
    class Broken(SlowSmoke):
        def _apply(self, action):
            raise ZeroDivisionError("engine bug")

    with pytest.raises(ZeroDivisionError):
        asyncio.run(SandboxCalls(1.0)("step", _box(Broken), "step", "east"))
