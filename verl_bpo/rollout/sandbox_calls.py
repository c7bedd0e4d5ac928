"""Every call the tree sampler makes into a sandbox: off the event loop, under a time limit, timed.

Sandbox engines are synchronous (a text game, a subprocess, a container); they run on worker threads so that the
many branches of many trees on one event loop step concurrently. Engines that are not thread-safe
(``Sandbox.thread_safe = False``: TextWorld's shared grammar parser) run one call of their class at a time.
Engines that declare ``Sandbox.blocking = False`` (pure in-process state that steps in microseconds and cannot
hang: the smoke corridor, the tabular oracle) are called on the event loop directly.

The time limit (``bpo.step_timeout_s``) starts when the call starts running, not while it waits for a thread or
for its engine's lock, so a busy worker never turns a slow queue into failed leaves. A call that runs past it
raises :class:`~sandbox_adapters.base.SandboxTimeout`, which fails one leaf; its sandbox is quarantined (never
called again, closed without waiting) and, for a serialised engine class, the class gets a fresh lock, so a call
that never returns cannot hold every later tree.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
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

# Sandbox calls block on engines, subprocesses and containers: a pool of their own, so that they never queue
# behind (or starve) the event loop's default executor, and hung calls do not exhaust it.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=128, thread_name_prefix="bpo-sandbox")
_ENGINE_LOCKS: dict[type, threading.Lock] = {}
_ENGINE_LOCKS_GUARD = threading.Lock()


def _engine_lock(cls: type) -> threading.Lock:
    with _ENGINE_LOCKS_GUARD:
        return _ENGINE_LOCKS.setdefault(cls, threading.Lock())


def _replace_engine_lock(cls: type, hung: threading.Lock) -> None:
    with _ENGINE_LOCKS_GUARD:
        if _ENGINE_LOCKS.get(cls) is hung:
            _ENGINE_LOCKS[cls] = threading.Lock()


class SandboxCalls:
    """Runs sandbox calls for one tree and records how long each kind took (``seconds[kind]``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self._quarantined: weakref.WeakSet[Sandbox] = weakref.WeakSet()

    async def __call__(self, kind: str, sandbox: Sandbox, method: str, *args: Any) -> Any:
        """``sandbox.<method>(*args)``; ``kind`` names the timing (reset, step, snapshot, restore, close)."""
        if sandbox in self._quarantined:
            raise SandboxTimeout(f"{type(sandbox).__name__} is quarantined after a call that hung")
        fn: Callable[..., Any] = getattr(sandbox, method)
        if not type(sandbox).blocking:  # microsecond in-process engines: a thread hop would cost 100x the call
            begin = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[kind].append(time.perf_counter() - begin)
        serialised = not type(sandbox).thread_safe
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        held: list[threading.Lock] = []
        elapsed: list[float] = []

        def run() -> Any:
            with _holding(type(sandbox), held) if serialised else contextlib.nullcontext():
                loop.call_soon_threadsafe(_set_if_pending, started, None)
                begin = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    elapsed.append(time.perf_counter() - begin)

        done = loop.run_in_executor(_POOL, run)
        try:
            await asyncio.wait({started, done}, return_when=asyncio.FIRST_COMPLETED)
            return await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
        except asyncio.TimeoutError:
            self._quarantine(sandbox, held[0] if held else None)
            raise SandboxTimeout(
                f"{type(sandbox).__name__}.{method} ran for {self.timeout_s:g} s without returning "
                "(bpo.step_timeout_s); the sandbox is quarantined and this leaf ends"
            ) from None
        finally:
            if not started.done():
                started.cancel()
            self.seconds[kind].append(elapsed[0] if elapsed else self.timeout_s)

    def _quarantine(self, sandbox: Sandbox, lock: threading.Lock | None) -> None:
        self._quarantined.add(sandbox)
        if lock is not None:
            _replace_engine_lock(type(sandbox), lock)

    async def close(self, sandbox: Sandbox) -> None:
        """Close ``sandbox``, best effort (the leaf is already final). A quarantined sandbox is closed on its own
        thread without waiting: its hung call may never return."""
        if sandbox in self._quarantined:
            threading.Thread(target=_close_quietly, args=(sandbox,), daemon=True).start()
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


def _set_if_pending(future: asyncio.Future, value: None) -> None:
    if not future.done():
        future.set_result(value)


def _close_quietly(sandbox: Sandbox) -> None:
    try:
        sandbox.close()
    except Exception:
        logger.warning("closing a quarantined %s failed", type(sandbox).__name__, exc_info=True)
