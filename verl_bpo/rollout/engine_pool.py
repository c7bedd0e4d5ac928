"""Engines that are not thread-safe, in processes of their own: concurrent trees of one worker step in parallel,
and a hung call costs one process instead of its engine class.

Why. A non-thread-safe engine (``Sandbox.thread_safe = False``: ALFWorld's and TextWorld's grammar parsers are
module globals) runs one call at a time in a process (:mod:`~verl_bpo.rollout.sandbox_calls`), so the trees of one
agent-loop worker wait for each other, and the GIL would keep their Python-heavy steps on one CPU anyway. A class
opts in with the class attribute ``engine_process = True`` (ALFWorld and TextWorld do); ``SandboxCalls`` then runs
its sandboxes in this module's engine processes.

How a sandbox is bound. The tree sampler makes its sandboxes in this process and calls them only through
``SandboxCalls``. At a sandbox's first call, a reset, the pool ships the still un-reset sandbox (pickled: little
more than its config) to the least loaded of its engine processes (``ENGINE_PROCESSES``, started as needed), which
keeps it; every later call of that sandbox runs there, one call at a time per process. A snapshot stays in the
process that took it (its payload is the engine's own state, which often does not pickle): this process gets a
:class:`~sandbox_adapters.base.Snapshot` with the same kind, task, actions and ``done`` whose payload names the
remote one (closing it frees the remote one), and a sandbox whose first call restores such a snapshot is bound to
the same process. So a tree lives in one engine process and concurrent trees spread over the processes.

The local sandbox object stays un-reset: the sampler only renders chat text with it (``system_prompt``,
``opening_chat``, ``render_observation``), which for an opted-in class must depend on its config and the
observation alone.

Time limits and hangs. The engine process says when it starts each call; ``bpo.step_timeout_s`` counts from there
(not while the call queues behind others of its process, nor while the process starts). A call past its limit
kills its process: the sandboxes bound to it end their leaves (their later calls fail at once, saying why), new
sandboxes go to a fresh process, and nothing of the hung call is left running. A process that dies fails its
calls with ``SandboxCrashed``. Engine processes end with this one (their socket closes; a watchdog also ends one
whose parent died while a call hangs).

Working directory. Each engine process runs in a private temporary directory (``bpo-engine-*``), removed when
the process ends (by this process once it has exited, killed or not, and by the engine process itself when it ends
on its own): an engine's interpreter can write files where it runs (a Z-machine's "save", "script", and its record
hot key), and none of that may land where the trainer runs or outlive the process. Paths a sandbox's config or task
gives relative to the trainer's directory are resolved by the sandbox when it is made here, before it is shipped.

Run in this process as before (:mod:`~verl_bpo.rollout.sandbox_calls`): a sandbox that does not pickle (e.g. one a
test monkeypatched), one whose first call is neither a reset nor a restore of an engine-process snapshot, and all
of them when ``BPO_ENGINE_PROCESSES=0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

from sandbox_adapters.base import RestoreFailed, Sandbox, SandboxCrashed, SandboxTimeout, Snapshot

__all__ = ["EnginePool", "ENGINE_PROCESSES", "shared_pool"]

logger = logging.getLogger(__name__)

# The private working directory of each engine process (tempfile.mkdtemp's prefix).
WORKDIR_PREFIX = "bpo-engine-"
# Engine processes per worker process (each holds whole trees; more trees than processes share them).
ENGINE_PROCESSES = int(os.environ.get("BPO_ENGINE_PROCESSES", max(2, min(8, os.cpu_count() or 1))))


@dataclasses.dataclass(frozen=True)
class _SnapshotRef:
    """A snapshot kept by the engine process, as a call's argument."""

    snap_id: int


@dataclasses.dataclass(frozen=True)
class _SnapshotInfo:
    """A snapshot kept by the engine process, as a call's result: what this process may know of it."""

    snap_id: int
    kind: Any
    task: Any
    actions: tuple[str, ...]
    done: bool


@dataclasses.dataclass(frozen=True)
class _RemoteSnapshot:
    """The payload of a local Snapshot whose state lives in ``process``."""

    process: EngineProcess
    snap_id: int


class EngineCall:
    """One call running in an engine process; ``started`` and ``done`` are futures of the caller's loop (the same
    shape as a thread-pool call of :mod:`~verl_bpo.rollout.sandbox_calls`)."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.name, self.loop = name, loop
        self.started, self.done = loop.create_future(), loop.create_future()
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody may await a stopped call
        self.began: float | None = None
        self.ended: float | None = None

    def start(self) -> None:
        self.began = time.perf_counter()
        self._post(self.started, None, None)

    def finish(self, value: Any, error: BaseException | None) -> None:
        self.ended = time.perf_counter() if self.began is not None else None
        self._post(self.done, value, error)

    def _post(self, future: asyncio.Future, value: Any, error: BaseException | None) -> None:
        def resolve() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            self.loop.call_soon_threadsafe(resolve)


class EngineProcess:
    """One engine process: its sandboxes, snapshots and calls. Calls run there one at a time, in order. Requests
    are pickled by the caller and written by a thread of their own (a full socket never blocks an event loop);
    replies are read by another."""

    def __init__(self, index: int) -> None:
        ours, theirs = socket.socketpair()
        self.workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
        # removed by the reader once the process has exited, or at this process's exit when the reader (a daemon)
        # does not get to it: a finalizer runs once
        self._workdir_finalizer = weakref.finalize(self, shutil.rmtree, self.workdir, True)
        path = [os.path.abspath(p) for p in sys.path]  # "" meant this process's directory, not the engine's
        code = (f"import sys; sys.path[:0] = {path!r}; "
                f"from verl_bpo.rollout.engine_pool import serve; serve({theirs.fileno()}, {self.workdir!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, cwd=self.workdir)
        theirs.close()
        self.name = f"engine process {index} (pid {self.proc.pid})"
        self._sock = ours  # kept for the half-close at shutdown
        self._conn = Connection(os.dup(ours.fileno()))
        self._lock = threading.Lock()  # guards the fields below
        self._calls: dict[int, EngineCall] = {}
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # put() is safe from finalizers
        self.bound = 0  # sandboxes bound to it
        self.stopped: BaseException | None = None  # why it no longer serves (the error later calls get)
        threading.Thread(target=self._write, name=f"bpo-engine-{index}-writer", daemon=True).start()
        threading.Thread(target=self._read, name=f"bpo-engine-{index}-reader", daemon=True).start()

    # --- requests ---------------------------------------------------------------------------------------------
    def ship(self, sid: int, blob: bytes) -> None:
        if self.stopped is None:
            self._outbox.put(pickle.dumps(("new", sid, blob)))

    def call(self, sid: int, name: str, method: str, args: tuple, loop: asyncio.AbstractEventLoop) -> EngineCall:
        call = EngineCall(name, loop)
        try:  # pickled here, so that an argument that does not pickle fails this call alone
            blob = pickle.dumps(tuple(self._outgoing(arg) for arg in args))
        except RestoreFailed as exc:
            call.finish(None, exc)
            return call
        except Exception as exc:  # an argument that does not pickle
            call.finish(None, SandboxCrashed(f"{name} could not be sent to {self.name}: {exc!r}"))
            return call
        with self._lock:
            if self.stopped is not None:
                call.finish(None, _copy(self.stopped))
                return call
            cid = next(self._ids)
            self._calls[cid] = call
        self._outbox.put(pickle.dumps(("call", cid, sid, method, blob)))
        return call

    def free_later(self, what: str, ident: int) -> None:
        """Forget a sandbox (``"forget"``) or free a snapshot (``"drop"``) there; safe from a finalizer."""
        if self.stopped is None:
            self._outbox.put(pickle.dumps((what, ident)))

    def stop(self, error: BaseException) -> None:
        """Kill the process; its pending calls and every later one fail with ``error`` (or with the reason it was
        stopped for first)."""
        with self._lock:
            first = self.stopped is None
            if first:
                self.stopped = error
            pending, self._calls = list(self._calls.values()), {}
        if first:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self._outbox.put(None)
        for call in pending:
            call.finish(None, _copy(self.stopped))

    def shutdown(self) -> None:
        """End the process once it has answered what it was sent (it exits when its socket closes)."""
        with self._lock:
            if self.stopped is None:
                self.stopped = SandboxCrashed(f"{self.name} was shut down")
        self._outbox.put(None)

    def _outgoing(self, arg: Any) -> Any:
        if isinstance(arg, Snapshot) and isinstance(arg.payload, _RemoteSnapshot):
            if arg.payload.process is not self:
                raise RestoreFailed("the snapshot was taken in another engine process than this sandbox's")
            return _SnapshotRef(arg.payload.snap_id)
        return arg

    # --- the writer and reader threads ------------------------------------------------------------------------
    def _write(self) -> None:
        while (blob := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(blob)
            except OSError:
                break
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)  # the process sees the end of its requests and exits

    def _read(self) -> None:
        while True:
            try:
                kind, cid, *rest = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a reply that does not unpickle here: its call is unknown, give up the process
                self.stop(SandboxCrashed(f"a reply from {self.name} could not be read: {exc!r}"))
                break
            with self._lock:
                call = self._calls.get(cid) if kind == "started" else self._calls.pop(cid, None)
            if call is None:  # stopped meanwhile
                continue
            if kind == "started":
                call.start()
            else:
                value, error = rest
                call.finish(self._incoming(value), error)
        code = self.proc.wait()
        self._workdir_finalizer()
        self.stop(SandboxCrashed(f"{self.name} exited with code {code}"))
        self._conn.close()
        self._sock.close()

    def _incoming(self, value: Any) -> Any:
        if not isinstance(value, _SnapshotInfo):
            return value
        snapshot = Snapshot(value.kind, value.task, value.actions, _RemoteSnapshot(self, value.snap_id),
                            done=value.done)
        # closing the snapshot (or dropping it) frees the remote one
        free = weakref.finalize(snapshot, self.free_later, "drop", value.snap_id)
        object.__setattr__(snapshot, "release", free)  # a frozen dataclass; the field exists for this
        return snapshot


def _copy(error: BaseException) -> BaseException:
    """A fresh instance of ``error`` for each call it fails (a raised exception keeps its own traceback)."""
    return type(error)(*error.args)


@dataclasses.dataclass
class _Binding:
    process: EngineProcess
    sid: int
    free: weakref.finalize


class EnginePool:
    """Up to ``processes`` engine processes and the sandboxes bound to them (see the module docstring)."""

    def __init__(self, processes: int = ENGINE_PROCESSES) -> None:
        if processes < 1:
            raise ValueError(f"EnginePool needs at least one process, got {processes}")
        self.processes = processes
        self._lock = threading.Lock()
        self._live: list[EngineProcess] = []
        self._bound: weakref.WeakKeyDictionary[Sandbox, _Binding] = weakref.WeakKeyDictionary()
        self._local: weakref.WeakSet[Sandbox] = weakref.WeakSet()  # decided at their first call: not pooled
        self._sids = itertools.count()
        self._started = 0

    def call(self, sandbox: Sandbox, name: str, method: str, args: tuple,
             loop: asyncio.AbstractEventLoop) -> EngineCall | None:
        """``sandbox.<method>(*args)`` in its engine process; None when the sandbox runs in this process."""
        with self._lock:
            binding = self._bound.get(sandbox)
            if binding is None:
                binding = self._bind(sandbox, method, args)
                if binding is None:
                    return None
            if method == "close":  # its last call: the process forgets it afterwards
                self._unbind(sandbox, binding)
        return binding.process.call(binding.sid, name, method, args, loop)

    def bound(self, sandbox: Sandbox) -> bool:
        """True when ``sandbox`` runs in an engine process."""
        return sandbox in self._bound

    def stopped(self, sandbox: Sandbox) -> bool:
        """True when ``sandbox`` is bound to a process that no longer serves."""
        binding = self._bound.get(sandbox)
        return binding is not None and binding.process.stopped is not None

    def stop(self, sandbox: Sandbox, name: str, timeout_s: float) -> str:
        """A call of ``sandbox`` ran past its limit: kill its process. Returns what that means, for the error."""
        binding = self._bound.get(sandbox)
        if binding is None:
            return ""
        binding.process.stop(SandboxTimeout(
            f"{binding.process.name} was stopped: {name} ran past bpo.step_timeout_s={timeout_s:g} in it, and every "
            "sandbox bound to that process ends its leaf."))
        with self._lock:
            if binding.process in self._live:
                self._live.remove(binding.process)
        return (f" Its {binding.process.name} was killed with the call: the other sandboxes bound to it end their "
                f"leaves, and later sandboxes go to a fresh process.")

    def forget(self, sandbox: Sandbox) -> None:
        """Drop ``sandbox`` without calling it (its process was stopped, or it is quarantined)."""
        with self._lock:
            binding = self._bound.get(sandbox)
            if binding is not None:
                self._unbind(sandbox, binding)
                binding.process.free_later("forget", binding.sid)

    def shutdown(self) -> None:
        with self._lock:
            live, self._live = self._live, []
        for process in live:
            process.shutdown()

    # --- under the lock ---------------------------------------------------------------------------------------
    def _bind(self, sandbox: Sandbox, method: str, args: tuple) -> _Binding | None:
        if sandbox in self._local:
            return None
        if method == "restore" and args and isinstance(args[0], Snapshot) and isinstance(args[0].payload,
                                                                                         _RemoteSnapshot):
            process = args[0].payload.process
        elif method == "reset":
            process = self._least_loaded()
        else:
            self._local.add(sandbox)
            return None
        try:
            blob = pickle.dumps(sandbox)
        except Exception as exc:
            logger.info("a %s runs in this process: it does not pickle (%r)", type(sandbox).__name__, exc)
            self._local.add(sandbox)
            return None
        sid = next(self._sids)
        process.ship(sid, blob)  # a stopped process ships nothing; the call then fails with its reason
        process.bound += 1
        binding = _Binding(process, sid, weakref.finalize(sandbox, process.free_later, "forget", sid))
        self._bound[sandbox] = binding
        return binding

    def _unbind(self, sandbox: Sandbox, binding: _Binding) -> None:
        binding.free.detach()
        binding.process.bound -= 1
        self._bound.pop(sandbox, None)

    def _least_loaded(self) -> EngineProcess:
        self._live = [p for p in self._live if p.stopped is None]
        idle = [p for p in self._live if p.bound == 0]
        if idle:
            return idle[0]
        if len(self._live) < self.processes:
            self._started += 1
            self._live.append(EngineProcess(self._started))
            return self._live[-1]
        return min(self._live, key=lambda p: p.bound)


_SHARED: EnginePool | None = None
_SHARED_GUARD = threading.Lock()


def shared_pool() -> EnginePool | None:
    """This process's pool, made at first use; None when ``ENGINE_PROCESSES`` is 0 (``BPO_ENGINE_PROCESSES=0``)."""
    global _SHARED
    if ENGINE_PROCESSES < 1:
        return None
    with _SHARED_GUARD:
        if _SHARED is None:
            _SHARED = EnginePool(ENGINE_PROCESSES)
        return _SHARED


def _forget_processes() -> None:
    """A forked child does not own its parent's engine processes."""
    global _SHARED, _SHARED_GUARD
    _SHARED, _SHARED_GUARD = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_processes)


# ---------------------------------------------------------------------------------------------------------------
# The engine process


def serve(fd: int, workdir: str | None = None) -> None:
    """The engine process: build the sandboxes it is sent and run their calls, one at a time, until its socket
    closes; then remove ``workdir``, the private directory it ran in (see the module docstring)."""
    _die_with_parent(workdir)
    try:
        _serve(fd)
    finally:
        _remove_workdir(workdir)


def _remove_workdir(workdir: str | None) -> None:
    """Remove an engine process's private directory, and only one: a name this module made."""
    if workdir and os.path.basename(workdir).startswith(WORKDIR_PREFIX):
        shutil.rmtree(workdir, ignore_errors=True)


def _serve(fd: int) -> None:
    conn = Connection(fd)
    boxes: dict[int, Any] = {}  # sid -> sandbox, or the error that kept it from being built
    snapshots: dict[int, Snapshot] = {}
    snap_ids = itertools.count()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        op = message[0]
        if op == "new":
            _, sid, blob = message
            try:
                boxes[sid] = pickle.loads(blob)
            except Exception as exc:
                boxes[sid] = exc
        elif op == "forget":
            box = boxes.pop(message[1], None)
            if isinstance(box, Sandbox):
                _close_quietly(box)
        elif op == "drop":
            snapshot = snapshots.pop(message[1], None)
            if snapshot is not None:
                with contextlib.suppress(Exception):
                    snapshot.close()
        elif op == "call":
            _, cid, sid, method, blob = message
            conn.send(("started", cid))
            value, error = _run(boxes, snapshots, sid, method, blob)
            if isinstance(value, Snapshot):
                snap_id = next(snap_ids)
                snapshots[snap_id] = value
                value = _SnapshotInfo(snap_id, value.kind, dict(value.task), tuple(value.actions), value.done)
            if method == "close":
                boxes.pop(sid, None)
            try:
                conn.send(("done", cid, value, error))
            except Exception as exc:  # a value that does not pickle
                conn.send(("done", cid, None, SandboxCrashed(f"{method} returned a value that does not pickle: "
                                                             f"{exc!r}")))
    for box in boxes.values():
        if isinstance(box, Sandbox):
            _close_quietly(box)


def _run(boxes: dict[int, Any], snapshots: dict[int, Snapshot], sid: int, method: str,
         blob: bytes) -> tuple[Any, BaseException | None]:
    try:
        args = pickle.loads(blob)
        box = boxes.get(sid)
        if not isinstance(box, Sandbox):
            raise SandboxCrashed(f"the sandbox could not be built in the engine process: {box!r}")
        if any(isinstance(arg, _SnapshotRef) and arg.snap_id not in snapshots for arg in args):
            raise RestoreFailed("the snapshot was closed before this restore")
        args = tuple(snapshots[arg.snap_id] if isinstance(arg, _SnapshotRef) else arg for arg in args)
        return getattr(box, method)(*args), None
    except BaseException as exc:  # handed to the caller, as it would be in its own process
        return None, _portable(exc)


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a SandboxCrashed that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return SandboxCrashed(f"{error!r} (raised in the engine process)")


def _close_quietly(box: Sandbox) -> None:
    try:
        box.close()
    except Exception:
        logger.warning("closing a %s in its engine process failed", type(box).__name__, exc_info=True)


def _die_with_parent(workdir: str | None) -> None:
    """End this process when its parent is gone, even while an engine call hangs (a closed socket alone is only
    seen between calls); its private directory goes with it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        _remove_workdir(workdir)
        os._exit(1)

    threading.Thread(target=watch, name="bpo-engine-parent-watch", daemon=True).start()
