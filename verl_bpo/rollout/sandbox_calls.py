"""Every call the tree sampler makes into a sandbox: off the event loop, under a time limit, timed, on a bounded
number of threads.

Threads. Sandbox engines are synchronous (a text game, a subprocess, a container); their calls run on the
process's :class:`CallExecutor`, so that the many branches of many trees on one event loop step concurrently.
``CALL_THREADS`` threads (``max(32, 4 x CPUs)``: most calls wait on a subprocess or a container, not on a CPU)
serve the calls, started as they are needed. Engines that declare ``Sandbox.blocking = False`` (pure in-process
state that steps in microseconds and cannot hang: the smoke corridor, the tabular oracle) are called on the event
loop directly.

Time limit. ``bpo.step_timeout_s`` starts when the call starts running, not while it waits for a thread or for its
engine (below), so a busy worker never turns a slow queue into failed leaves. A call that runs past it raises
:class:`~sandbox_adapters.base.SandboxTimeout` (the sampler retries the step on a rebuilt sandbox); its sandbox
is quarantined (never called again, and closed on a thread of its own without waiting, which for process-backed
sandboxes kills the hung command; at most ``MAX_CLOSE_THREADS`` such closes run at once, a sandbox beyond that is
left open and logged; a sandbox of a retired engine class is closed by the hung call's own thread when that call
returns, since closing it earlier would enter the engine beside the hung call).

Hung calls. Python cannot stop a thread, so a call past its limit is abandoned and its thread counts as *lost*: it
may never return. The executor starts a replacement for it, but never holds more than ``MAX_CALL_THREADS`` live
threads (``2 x CALL_THREADS``); a lost thread that returns serves again, or ends when enough healthy threads
serve without it. Once every live thread is lost at the cap, a call fails at once with a SandboxTimeout that says
so (one leaf), as do the calls still queued, rather than queueing behind calls that may never return: a process
where calls keep hanging holds a bounded number of threads and answers every call.

Engines that are not thread-safe (``Sandbox.thread_safe = False``) keep state that the whole process shares and
that concurrent calls corrupt: TextWorld's and ALFWorld's grammar parsers are module globals of TextWorld. One
call of such a class runs at a time in this process; the others wait for it on the event loop (holding no
thread). A call of such a class that hangs may still be running inside that shared state, and nothing in the
process can stop it or give the class a fresh copy of module globals, so the class is *retired* while that call
runs: the calls waiting for it and every later call of the class in this process fail at once with a
SandboxTimeout naming the hung call (one leaf each), and the class serves again as soon as the hung call returns
(``hung_engine(cls)`` tells whether it is retired). The alternatives are worse: giving the class a fresh lock lets
a second call enter an engine the hung call is still inside (what this module did before), and waiting for the
hung call holds every later tree. Sandboxes of a retired class are not closed either (closing enters the engine);
they are left to the garbage collector.

Engine processes. Only an engine in a process of its own can be given up without giving up its class, and only
there do the trees of one worker step such an engine in parallel. Classes that declare ``engine_process = True``
(ALFWorld, TextWorld) therefore run in the engine processes of :mod:`~verl_bpo.rollout.engine_pool`: a tree's
sandboxes live in one process, one call at a time there, concurrent trees in different ones, and a call past its
limit kills its process (the tree's other leaves in it fail; later trees get a fresh process). What stays in this
process, under the rules above: every other non-thread-safe class, and an opted-in sandbox that does not pickle.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sandbox_adapters.base import Sandbox, SandboxTimeout
from verl_bpo.rollout.engine_pool import EngineCall, EnginePool, shared_pool

__all__ = ["SandboxCalls", "CallExecutor", "hung_engine", "CALL_THREADS", "MAX_CALL_THREADS", "MAX_CLOSE_THREADS"]

logger = logging.getLogger(__name__)

# Threads serving sandbox calls in one process, and the most that may be alive, lost ones included.
CALL_THREADS = max(32, 4 * (os.cpu_count() or 1))
MAX_CALL_THREADS = 2 * CALL_THREADS
# Closes of quarantined sandboxes running at once (each on its own thread: the executor may be full of hung calls).
MAX_CLOSE_THREADS = 8


class SandboxCalls:
    """Runs sandbox calls for one tree and records how long each kind took (``seconds[kind]``).

    ``executor``: the threads that run blocking calls; the process's shared one when omitted.
    ``engines``: the engine processes of classes with ``engine_process = True``; the process's shared pool when
    omitted (:mod:`~verl_bpo.rollout.engine_pool`).
    """

    def __init__(self, timeout_s: float, executor: CallExecutor | None = None,
                 engines: EnginePool | None = None) -> None:
        self.timeout_s = timeout_s
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._executor = executor
        self._engines = engines
        self._quarantined: weakref.WeakSet[Sandbox] = weakref.WeakSet()

    async def __call__(self, kind: str, sandbox: Sandbox, method: str, *args: Any) -> Any:
        """``sandbox.<method>(*args)``; ``kind`` names the timing (reset, step, snapshot, restore, close)."""
        cls = type(sandbox)
        name = f"{cls.__name__}.{method}"
        if sandbox in self._quarantined:
            raise SandboxTimeout(f"{name} was not called: this sandbox is quarantined after an earlier call ran "
                                 f"past bpo.step_timeout_s={self.timeout_s:g}")
        if not cls.blocking:  # microsecond in-process engines: a thread hop would cost 100x the call
            begin = time.perf_counter()
            try:
                return getattr(sandbox, method)(*args)
            finally:
                self.seconds[kind].append(time.perf_counter() - begin)
        loop, queued = asyncio.get_running_loop(), time.perf_counter()
        pool = self._pool(cls)
        remote = pool.call(sandbox, name, method, args, loop) if pool is not None else None
        if remote is not None:
            return await self._outcome(kind, name, sandbox, remote, queued, "its engine process",
                                       on_timeout=lambda: pool.stop(sandbox, name, self.timeout_s))
        gate = None if cls.thread_safe else _engine_gate(cls)
        token = await gate.acquire(name, self.timeout_s) if gate is not None else None
        job = _Job(name, getattr(sandbox, method), args, loop,
                   release=(lambda: gate.release(token)) if gate is not None else None)
        executor = self._executor or _shared_executor()
        executor.submit(job)  # a job it can never run fails at once, through job.done

        def abandon() -> str:
            executor.abandon(job)
            if gate is None or not gate.retire(token, name):
                return " It is closed on a thread of its own."
            return (f" It is closed on a thread of its own. {cls.__name__} is not thread-safe and the call may still "
                    f"be running inside its engine, so calls of {cls.__name__} in this process fail at once until it "
                    "returns.")

        try:
            return await self._outcome(kind, name, sandbox, job, queued,
                                       "a thread" + (" and its engine" if gate is not None else ""), abandon)
        except asyncio.CancelledError:
            executor.cancel(job)  # a job that has not started never will (and frees its engine)
            raise

    async def _outcome(self, kind: str, name: str, sandbox: Sandbox, job: _Job | EngineCall, queued: float,
                       waits_for: str, on_timeout: Callable[[], str | None]) -> Any:
        """The result of a submitted call, under the time limit counted from when it started."""
        try:
            await asyncio.wait({job.started, job.done}, return_when=asyncio.FIRST_COMPLETED)
            return await asyncio.wait_for(asyncio.shield(job.done), self.timeout_s)
        except asyncio.TimeoutError:
            self._quarantined.add(sandbox)
            consequence = on_timeout() or ""
            waited = (job.began or queued) - queued
            raise SandboxTimeout(
                f"{name} ran for {self.timeout_s:g} s without returning (bpo.step_timeout_s={self.timeout_s:g}; "
                f"counted from when it started, after {waited:.2f} s waiting for {waits_for}). The sandbox is "
                "quarantined (never called again) and the step fails (the sampler retries it on a rebuilt "
                f"sandbox).{consequence}"
            ) from None
        finally:
            if job.began is not None:  # a call that never ran is not timed; a hung one counts its limit
                ended = job.ended if job.ended is not None else job.began + self.timeout_s
                self.seconds[kind].append(ended - job.began)

    async def close(self, sandbox: Sandbox) -> None:
        """Close ``sandbox``, best effort (the leaf is already final). A quarantined sandbox of a thread-safe class
        is closed on its own thread without waiting: its hung call may never return. A non-thread-safe class's
        sandbox never closes beside another call of its class: while the class is retired, the hung call's thread
        closes it when that call returns; otherwise it is closed through the class's gate like any call (its own
        hung call, if it had one, has returned)."""
        cls = type(sandbox)
        pool = self._pool(cls)
        if pool is not None and pool.bound(sandbox) and (sandbox in self._quarantined or pool.stopped(sandbox)):
            pool.forget(sandbox)  # its engine process was killed: nothing is left to close
            return
        if not cls.thread_safe and cls.blocking and _engine_gate(cls).defer_close(sandbox):
            return
        if sandbox in self._quarantined:
            if cls.thread_safe:
                _close_in_background(sandbox)
                return
            self._quarantined.discard(sandbox)  # its hung call returned: closing it is an ordinary call now
        try:
            await self("close", sandbox, "close")
        except Exception:
            logger.warning("closing a %s failed", cls.__name__, exc_info=True)

    def _pool(self, cls: type) -> EnginePool | None:
        """The engine processes for ``cls``'s sandboxes, None when they run in this process."""
        if not getattr(cls, "engine_process", False):
            return None
        return self._engines if self._engines is not None else shared_pool()


# ---------------------------------------------------------------------------------------------------------------
# The executor


class _Job:
    """One sandbox call: run once on an executor thread, or failed without running. Its outcome reaches the
    awaiting coroutine through ``started`` and ``done``, futures of the coroutine's loop."""

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple, loop: asyncio.AbstractEventLoop,
                 release: Callable[[], None] | None = None) -> None:
        self.name, self.fn, self.args, self.loop = name, fn, args, loop
        self.release = release  # frees the engine gate the call holds
        self.started, self.done = loop.create_future(), loop.create_future()
        # a call that outlives its timeout may still fail later, when nobody awaits it: mark that as seen
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.began: float | None = None
        self.ended: float | None = None
        self.lost = False  # abandoned past its time limit while running (the executor's lock guards this)

    def run(self) -> None:
        self.began = time.perf_counter()
        self._post(self.started, None, None)
        try:
            value, error = self.fn(*self.args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            value, error = None, exc
        self.ended = time.perf_counter()
        self._settle(value, error)

    def fail(self, error: BaseException) -> None:
        """End a call that never ran."""
        self._settle(None, error)

    def _settle(self, value: Any, error: BaseException | None) -> None:
        if self.release is not None:
            self.release()
        self._post(self.done, value, error)

    def _post(self, future: asyncio.Future, value: Any, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_resolve, future, value, error)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass


class CallExecutor:
    """A bounded pool of threads for blocking sandbox calls: ``threads`` healthy threads at most, ``max_threads``
    live ones (lost ones included) at most; see the module docstring."""

    def __init__(self, threads: int = CALL_THREADS, max_threads: int = MAX_CALL_THREADS) -> None:
        if not 1 <= threads <= max_threads:
            raise ValueError(f"CallExecutor needs 1 <= threads <= max_threads, got {threads}, {max_threads}")
        self.threads, self.max_threads = threads, max_threads
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: set[_Job] = set()
        self._live = 0  # threads started and not ended
        self._lost = 0  # of them, running an abandoned call
        self._idle = 0  # of them, waiting for a call (or about to take one)
        self._closed = False

    def counts(self) -> dict[str, int]:
        """Live, lost and idle threads, and queued calls."""
        with self._cond:
            return {"live": self._live, "lost": self._lost, "idle": self._idle, "queued": len(self._queue)}

    def submit(self, job: _Job) -> None:
        """Queue ``job``; it fails at once when no thread can ever run it (every live thread lost, at the cap)."""
        with self._cond:
            if self._exhausted():
                error = self._exhausted_error(job)
            else:
                error = None
                self._queue.append(job)
                self._start_threads()
                self._cond.notify()
        if error is not None:
            job.fail(error)

    def abandon(self, job: _Job) -> None:
        """``job`` ran past its time limit: its thread is lost; start a replacement, or, when none may start and
        no healthy thread is left, fail the queued calls."""
        with self._cond:
            if job not in self._running:  # it returned meanwhile
                return
            job.lost = True
            self._lost += 1
            self._start_threads()
            stranded = []
            if self._exhausted():
                stranded = [(queued, self._exhausted_error(queued)) for queued in self._queue]
                self._queue.clear()
        for queued, error in stranded:
            queued.fail(error)

    def cancel(self, job: _Job) -> bool:
        """Drop ``job`` if it has not started (nobody awaits it any more); True when it was dropped."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
        job.fail(asyncio.CancelledError())
        return True

    def shutdown(self) -> None:
        """Idle threads end, and so does each busy one when its call returns; queued calls still run."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- under the lock ---------------------------------------------------------------------------------------
    def _exhausted(self) -> bool:
        return self._live - self._lost == 0 and self._live >= self.max_threads

    def _exhausted_error(self, job: _Job) -> SandboxTimeout:
        return SandboxTimeout(
            f"{job.name} was not called: every sandbox call thread of this process ({self._live}, the cap "
            f"MAX_CALL_THREADS={self.max_threads}) is held by a call that ran past bpo.step_timeout_s and has not "
            "returned, so no thread is left to run it; the step fails. Calls run again once hung calls return.")

    def _start_threads(self) -> None:
        # a thread for each queued call no idle thread will take, while healthy threads are few and the cap allows
        while (len(self._queue) > self._idle and self._live - self._lost < self.threads
               and self._live < self.max_threads):
            self._live += 1
            self._idle += 1
            threading.Thread(target=self._serve, name=f"bpo-sandbox-call-{self._live}", daemon=True).start()

    # --- on each thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # shut down
                    self._idle -= 1
                    self._live -= 1
                    return
                job = self._queue.popleft()
                self._idle -= 1
                self._running.add(job)
                self._cond.release()
                try:
                    job.run()
                finally:
                    self._cond.acquire()
                self._running.discard(job)
                if job.lost:
                    self._lost -= 1
                    # a replacement took this thread's place while it was lost: one too many now
                    if self._live - self._lost > self.threads:
                        self._live -= 1
                        return
                if self._closed and not self._queue:
                    self._live -= 1
                    return
                self._idle += 1


_EXECUTOR: CallExecutor | None = None
_EXECUTOR_GUARD = threading.Lock()


def _shared_executor() -> CallExecutor:
    global _EXECUTOR
    with _EXECUTOR_GUARD:
        if _EXECUTOR is None:
            _EXECUTOR = CallExecutor(CALL_THREADS, MAX_CALL_THREADS)
        return _EXECUTOR


# ---------------------------------------------------------------------------------------------------------------
# Engines that are not thread-safe


class _Retired(Exception):
    """Handed to the calls waiting at a gate that was retired."""


class _EngineGate:
    """One call at a time of one non-thread-safe engine class in this process, retired while a hung call may still
    be inside. Waiting happens on the caller's event loop; the holder is identified by the token it got."""

    def __init__(self, cls: type) -> None:
        self.cls_name = cls.__name__
        self._lock = threading.Lock()
        self._holder: object | None = None
        self._waiters: collections.deque[tuple[object, asyncio.AbstractEventLoop, asyncio.Future]] = (
            collections.deque())
        self.hung: str | None = None  # the call that retired the class, while it runs
        self._closes: list[Sandbox] = []  # sandboxes to close when the hung call returns (it still holds the gate)

    async def acquire(self, name: str, timeout_s: float) -> object:
        """A token for :meth:`release` once this call may enter the engine; SandboxTimeout while retired."""
        token, loop = object(), asyncio.get_running_loop()
        with self._lock:
            if self.hung is not None:
                raise self._retired_error(name, timeout_s)
            if self._holder is None:
                self._holder = token
                return token
            granted = loop.create_future()
            self._waiters.append((token, loop, granted))
        try:
            await granted
        except _Retired:
            raise self._retired_error(name, timeout_s) from None
        except BaseException:  # cancelled: leave the queue, or pass on the gate if it was handed over meanwhile
            with self._lock:
                still_waiting = any(entry[0] is token for entry in self._waiters)
                if still_waiting:
                    self._waiters = collections.deque(e for e in self._waiters if e[0] is not token)
            if not still_waiting:
                self.release(token)
            raise
        return token

    def defer_close(self, sandbox: Sandbox) -> bool:
        """While the class is retired: close ``sandbox`` when the hung call returns, still inside the gate (closing
        enters the engine too). False when it is not retired."""
        with self._lock:
            if self.hung is None:
                return False
            self._closes.append(sandbox)
            return True

    def release(self, token: object) -> None:
        """The call holding ``token`` has returned: nothing is inside the engine; hand it to the next waiter."""
        with self._lock:
            if self._holder is not token:
                return
            closes, self._closes = self._closes, []
        for sandbox in closes:  # still holding the gate: nothing else is inside the engine
            _close_quietly(sandbox)
        with self._lock:
            self._holder, self.hung = None, None
            while self._waiters:
                self._holder, loop, granted = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(_resolve, granted, None, None)
                    return
                except RuntimeError:  # that waiter's loop is gone
                    self._holder = None

    def retire(self, token: object, name: str) -> bool:
        """The call holding ``token`` ran past its limit: fail the waiting calls, and later ones until it returns.
        False when it returned meanwhile (nothing to retire)."""
        with self._lock:
            if self._holder is not token:
                return False
            self.hung = name
            waiters, self._waiters = list(self._waiters), collections.deque()
        for _, loop, granted in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, granted, None, _Retired())
            except RuntimeError:
                pass
        return True

    def _retired_error(self, name: str, timeout_s: float) -> SandboxTimeout:
        cls = self.cls_name
        return SandboxTimeout(
            f"{name} was not called: {cls} is not thread-safe (its engine state is shared by the whole process) and "
            f"an earlier call, {self.hung}, ran past bpo.step_timeout_s={timeout_s:g} and may still be running inside "
            f"it. No call may enter {cls} beside it, so calls of {cls} in this process fail at once until it "
            "returns; the step fails.")


_GATES: dict[type, _EngineGate] = {}
_GATES_GUARD = threading.Lock()


def _engine_gate(cls: type) -> _EngineGate:
    with _GATES_GUARD:
        gate = _GATES.get(cls)
        if gate is None:
            gate = _GATES[cls] = _EngineGate(cls)
        return gate


def hung_engine(cls: type) -> str | None:
    """The call that retired the non-thread-safe engine class ``cls`` in this process while it still runs (e.g.
    ``"TextWorldSandbox.step"``), else None."""
    with _GATES_GUARD:
        gate = _GATES.get(cls)
    return None if gate is None else gate.hung


# ---------------------------------------------------------------------------------------------------------------
# Helpers

_CLOSERS = threading.BoundedSemaphore(MAX_CLOSE_THREADS)


def _close_in_background(sandbox: Sandbox) -> None:
    """Close a quarantined sandbox on a thread of its own, without waiting (its hung call may never return)."""
    if not _CLOSERS.acquire(blocking=False):
        logger.warning("a quarantined %s is left open: %d closes of quarantined sandboxes are still running",
                       type(sandbox).__name__, MAX_CLOSE_THREADS)
        return

    def close() -> None:
        try:
            _close_quietly(sandbox)
        finally:
            _CLOSERS.release()

    threading.Thread(target=close, name="bpo-sandbox-quarantine", daemon=True).start()


def _close_quietly(sandbox: Sandbox) -> None:
    try:
        sandbox.close()
    except Exception:
        logger.warning("closing a quarantined %s failed", type(sandbox).__name__, exc_info=True)


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _forget_threads() -> None:
    """In a forked child none of the parent's threads exist: start from an empty executor, gates and closers."""
    global _EXECUTOR, _EXECUTOR_GUARD, _GATES_GUARD, _CLOSERS
    _EXECUTOR, _EXECUTOR_GUARD = None, threading.Lock()
    _GATES.clear()
    _GATES_GUARD = threading.Lock()
    _CLOSERS = threading.BoundedSemaphore(MAX_CLOSE_THREADS)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads)
