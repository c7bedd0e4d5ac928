"""Every call the tree sampler makes into a sandbox: off the event loop, under a time limit, timed.

Sandbox engines are synchronous (a text game, a subprocess, a container); each call runs on a thread of its own so
that the many branches of many trees on one event loop step concurrently. Engines that are not thread-safe
(``Sandbox.thread_safe = False``: TextWorld's shared grammar parser) run one call of their class at a time.
Engines that declare ``Sandbox.blocking = False`` (pure in-process state that steps in microseconds and cannot
hang: the smoke corridor, the tabular oracle) are called on the event loop directly.

The time limit (``bpo.step_timeout_s``) starts when the call starts running, not while it waits for its engine's
lock, so a busy worker never turns a slow queue into failed leaves. A call that runs past it raises
:class:`~sandbox_adapters.base.SandboxTimeout`, which fails one leaf; its sandbox is quarantined (never called
again, and closed on a thread of its own without waiting, which for process-backed sandboxes kills the hung
command) and, for a serialised engine class, the class gets a fresh lock, so a call that never returns cannot
hold every later tree. Calls run on daemon threads rather than a pool: a hung call holds only its own thread, never
a pool slot that later calls need, and never keeps the process from exiting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from sandbox_adapters.base import Sandbox, SandboxTimeout

__all__ = ["SandboxCalls"]

logger = logging.getLogger(__name__)

_ENGINE_LOCKS: dict[type, threading.Lock] = {}
_ENGINE_LOCKS_GUARD = threading.Lock()


def _engine_lock(cls: type) -> threading.Lock:
    with _ENGINE_LOCKS_GUARD:
        return _ENGINE_LOCKS.setdefault(cls, threading.Lock())


def _replace_engine_lock(cls: type, hung: threading.Lock) -> bool:
    """A fresh lock for ``cls`` if ``hung`` is still its lock; True when this call replaced it."""
    with _ENGINE_LOCKS_GUARD:
        if _ENGINE_LOCKS.get(cls) is hung:
            _ENGINE_LOCKS[cls] = threading.Lock()
            return True
        return False


class SandboxCalls:
    """Runs sandbox calls for one tree and records how long each kind took (``seconds[kind]``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._quarantined: weakref.WeakSet[Sandbox] = weakref.WeakSet()

    async def __call__(self, kind: str, sandbox: Sandbox, method: str, *args: Any) -> Any:
        """``sandbox.<method>(*args)``; ``kind`` names the timing (reset, step, snapshot, restore, close)."""
        name = f"{type(sandbox).__name__}.{method}"
        if sandbox in self._quarantined:
            raise SandboxTimeout(f"{name} was not called: this sandbox is quarantined after an earlier call ran "
                                 f"past bpo.step_timeout_s={self.timeout_s:g}")
        fn: Callable[..., Any] = getattr(sandbox, method)
        if not type(sandbox).blocking:  # microsecond in-process engines: a thread hop would cost 100x the call
            begin = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[kind].append(time.perf_counter() - begin)
        serialised = not type(sandbox).thread_safe
        loop = asyncio.get_running_loop()
        started, done = loop.create_future(), loop.create_future()
        held: list[threading.Lock] = []
        clock: dict[str, float] = {"queued": time.perf_counter()}

        def run() -> None:
            try:
                with _holding(type(sandbox), held) if serialised else contextlib.nullcontext():
                    clock["began"] = time.perf_counter()
                    loop.call_soon_threadsafe(_resolve, started, None, None)
                    try:
                        value, error = fn(*args), None
                    except BaseException as exc:  # handed to the awaiting coroutine
                        value, error = None, exc
                    finally:
                        clock["ended"] = time.perf_counter()
            except BaseException as exc:  # the lock itself failed
                value, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(_resolve, done, value, error)

        # a call that outlives its timeout may still fail later, when nobody awaits it: mark that as seen
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        threading.Thread(target=run, name=f"bpo-sandbox-{kind}", daemon=True).start()
        try:
            await asyncio.wait({started, done}, return_when=asyncio.FIRST_COMPLETED)
            return await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
        except asyncio.TimeoutError:
            waited = clock.get("began", clock["queued"]) - clock["queued"]
            fresh_lock = self._quarantine(sandbox, held[0] if held else None)
            raise SandboxTimeout(
                f"{name} ran for {self.timeout_s:g} s without returning (bpo.step_timeout_s={self.timeout_s:g}; "
                f"counted from when it started, after {waited:.2f} s waiting"
                f"{' for its engine lock' if serialised else ''}). The sandbox is quarantined: it is closed on a "
                "thread of its own and never called again"
                f"{', and later calls of its class get a fresh engine lock' if fresh_lock else ''}; this leaf ends."
            ) from None
        finally:
            if not started.done():
                started.cancel()
            if "ended" in clock:
                self.seconds[kind].append(clock["ended"] - clock["began"])
            else:
                self.seconds[kind].append(self.timeout_s)

    def _quarantine(self, sandbox: Sandbox, lock: threading.Lock | None) -> bool:
        self._quarantined.add(sandbox)
        return lock is not None and _replace_engine_lock(type(sandbox), lock)

    async def close(self, sandbox: Sandbox) -> None:
        """Close ``sandbox``, best effort (the leaf is already final). A quarantined sandbox is closed on its own
        thread without waiting: its hung call may never return."""
        if sandbox in self._quarantined:
            threading.Thread(target=_close_quietly, args=(sandbox,), name="bpo-sandbox-quarantine",
                             daemon=True).start()
            return
        try:
            await self("close", sandbox, "close")
        except Exception:
            logger.warning("closing a %s failed", type(sandbox).__name__, exc_info=True)


@contextlib.contextmanager
def _holding(cls: type, held: list[threading.Lock]) -> Iterator[None]:
    """Hold ``cls``'s engine lock. A waiter re-reads the lock while it waits, so a lock replaced after a hang
    frees the calls already queued behind the hung one."""
    while True:
        lock = _engine_lock(cls)
        if lock.acquire(timeout=0.05):
            break
    held.append(lock)
    try:
        yield
    finally:
        lock.release()


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _close_quietly(sandbox: Sandbox) -> None:
    try:
        sandbox.close()
    except Exception:
        logger.warning("closing a quarantined %s failed", type(sandbox).__name__, exc_info=True)
