"""Snapshot-able workspace directories for the SWE sandbox: overlayfs layers or an in-memory copy of the files.

The agent's state is a directory (plus a cwd the adapter keeps), so a snapshot of the directory is exact. Two
backends with one interface (:class:`Workspace`):

* :class:`OverlayWorkspace` (``mount -t overlay``, root only): the directory is an overlay of read-only *layers*
  under one writable upper dir. ``snapshot()`` unmounts, turns the upper dir into a new read-only layer and mounts
  again on a fresh upper (a few ms, independent of repository size); ``restore()`` remounts the snapshot's layer
  stack under an empty upper. Layers are reference-counted directories shared by the sandbox and every snapshot
  that uses them; a layer is deleted when its last user lets go. Deep stacks are flattened into one layer
  (``max_layers``) to stay far below the kernel's limit on mount options.
* :class:`MemoryWorkspace` (portable): ``snapshot()`` records every file, directory and symlink in an immutable
  tuple; ``restore()`` rewrites only what differs. File contents are held only where the agent changed them:
  a file still equal to the pristine checkout is recorded as a reference to it, and a file unchanged since the
  last snapshot or restore (same size, inode, modification and change times) shares the bytes already held, so
  snapshots of a large repository cost memory in proportion to what the agent wrote, not to the repository
  (``max_snapshot_bytes`` bounds even that).

Disk: given a :class:`~sandbox_adapters.swebench.limits.QuotaDisk`, the writable part lives on it — the overlay's
upper dir and the layers its snapshots make (which keep the disk alive while they exist), or the memory
backend's whole directory — so the agent cannot write more than the disk holds.

A workspace can also be *mirrored* (``add_mirror``): bind-mounted at further host mount points, rebound after every
remount. A long-lived Docker container whose ``/testbed`` is a slave mount of such a point therefore always sees the
current state, although an overlay's snapshot or restore mounts a new overlay at ``path``.

Both also keep the task's pristine checkout (the *origin* layer) that grading copies, and hand it to any sandbox
that restores one of their snapshots. Host-side code never follows a symlink the agent created: the memory backend
records symlinks as links, fixes parents before children and replaces files instead of writing through them, and
the overlay backend only renames, copies (``cp -a``) and mounts.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import functools
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from sandbox_adapters.base import SandboxError
from sandbox_adapters.swebench.confine import chown_tree
from sandbox_adapters.swebench.limits import QuotaDisk

__all__ = ["Layer", "Workspace", "OverlayWorkspace", "MemoryWorkspace", "overlay_supported", "make_layer",
           "SnapshotTooLarge", "bind_mount", "detach_mount"]

class SnapshotTooLarge(SandboxError):
    """An in-memory snapshot would hold more changed bytes than ``max_snapshot_bytes``."""


_LOCK = threading.Lock()
_libc = ctypes.CDLL(None, use_errno=True)
_MS_BIND, _MNT_DETACH = 4096, 2


def bind_mount(source: str, target: str) -> None:
    """``mount --bind source target`` (root only)."""
    if _libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount --bind {source} {target}: {os.strerror(err)}")


def detach_mount(target: str) -> None:
    """``umount -l target``: detach the top mount at ``target`` (and its propagated copies) even if it is busy."""
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount -l {target}: {os.strerror(err)}")


# ---------------------------------------------------------------------------------------------------------------
# Layers: reference-counted read-only directories


class Layer:
    """A read-only directory tree (``self.path``) that lives in its own temp dir until its last reference goes.

    A layer made on a :class:`QuotaDisk` keeps a reference to the disk while it exists.
    """

    def __init__(self, disk: QuotaDisk | None = None) -> None:
        self._root = tempfile.mkdtemp(prefix="bpo-swe-layer-", dir=disk.path if disk is not None else None)
        self.path = os.path.join(self._root, "d")
        self._refs = 0
        self._disk = disk.acquire() if disk is not None else None

    def acquire(self) -> Layer:
        with _LOCK:
            self._refs += 1
        return self

    def release(self) -> None:
        with _LOCK:
            self._refs -= 1
            last = self._refs == 0
        if last:
            shutil.rmtree(self._root, ignore_errors=True)
            if self._disk is not None:
                self._disk.release()


def make_layer(source: str, uid: int | None) -> Layer:
    """A new layer holding a copy of ``source`` (ownership, modes and symlinks kept), owned by ``uid``."""
    layer = Layer()
    try:
        subprocess.run(["cp", "-a", "--", source, layer.path], check=True, capture_output=True)
        chown_tree(layer.path, uid)
    except BaseException:
        shutil.rmtree(layer._root, ignore_errors=True)
        raise
    return layer


def _release_all(layers: Sequence[Layer]) -> None:
    for layer in layers:
        layer.release()


class _State:
    """A snapshot payload: layers it keeps alive plus backend data. Released explicitly or when collected."""

    def __init__(self, layers: Sequence[Layer], files: tuple | None = None) -> None:
        self.layers = tuple(layer.acquire() for layer in layers)
        self.files = files
        self._finalizer = weakref.finalize(self, _release_all, self.layers)

    def release(self) -> None:
        self._finalizer()


# ---------------------------------------------------------------------------------------------------------------
# The interface


class Workspace(abc.ABC):
    """A host directory (``self.path``) the agent's commands see at the sandbox mount point.

    Args:
        uid: owner of every file the agent may write (the confinement's unprivileged uid), or None.
        disk: the size-limited filesystem the writable part lives on (None: the host's temp dir, no quota). The
            workspace takes over this reference.
    """

    def __init__(self, uid: int | None, disk: QuotaDisk | None = None) -> None:
        self.uid = uid
        self.disk = disk
        self._root = tempfile.mkdtemp(prefix="bpo-swe-ws-", dir=disk.path if disk is not None else None)
        self.path = os.path.join(self._root, "merged")
        os.mkdir(self.path)
        self.origin: Layer | None = None
        # host mount points that show the directory too (a Docker container's /testbed): target -> bound now
        self._mirrors: dict[str, bool] = {}
        self._mirrors_lock = threading.Lock()

    def add_mirror(self, target: str) -> None:
        """Keep the directory bind-mounted at ``target`` (root only), also across the remounts of snapshots and
        restores: a view made once, e.g. a long-lived container's, always shows the current state."""
        with self._mirrors_lock:
            self._mirrors[target] = False
            if self._shown():
                try:
                    self._bind_mirrors()
                except OSError:
                    self._mirrors.pop(target, None)
                    raise

    def remove_mirror(self, target: str) -> None:
        """Stop showing the directory at ``target`` (``target`` is an empty mount point again)."""
        with self._mirrors_lock:
            if self._mirrors.pop(target, False):
                detach_mount(target)

    def _shown(self) -> bool:
        """Whether ``self.path`` holds the workspace now (an overlay is unmounted during snapshots/restores)."""
        return True

    def _bind_mirrors(self) -> None:
        for target, bound in self._mirrors.items():
            if not bound:
                bind_mount(self.path, target)
                self._mirrors[target] = True

    def _unbind_mirrors(self) -> None:
        # before the directory is unmounted: a mirror would keep the old overlay (and its upper dir) in use
        for target, bound in self._mirrors.items():
            if bound:
                detach_mount(target)
                self._mirrors[target] = False

    def load(self, origin: Layer) -> None:
        """Make the directory a fresh copy of ``origin`` (a pristine checkout), which this workspace keeps."""
        self._set_origin(origin)
        self._load(origin)

    def snapshot(self) -> _State:
        """An immutable capture of the directory; call ``.release()`` on it when done."""
        return self._snapshot()

    def restore(self, state: object) -> None:
        """Make the directory equal to ``state`` (from any workspace of the same class)."""
        if type(state) is not _State or not state.layers:
            raise TypeError(f"not a {type(self).__name__} snapshot: {type(state).__name__}")
        self._restore(state)
        self._set_origin(state.layers[-1])

    def close(self) -> None:
        """Unmount and delete everything this workspace holds (snapshots keep their own layers)."""
        with self._mirrors_lock:
            self._unbind_mirrors()
            self._mirrors.clear()
        self._close()
        if self.origin is not None:
            self.origin.release()
            self.origin = None
        shutil.rmtree(self._root, ignore_errors=True)
        if self.disk is not None:
            self.disk.release()
            self.disk = None

    def _set_origin(self, origin: Layer) -> None:
        origin.acquire()
        if self.origin is not None:
            self.origin.release()
        self.origin = origin

    @abc.abstractmethod
    def _load(self, origin: Layer) -> None: ...

    @abc.abstractmethod
    def _snapshot(self) -> _State: ...

    @abc.abstractmethod
    def _restore(self, state: _State) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------------
# overlayfs


def _mount_overlay(lower: Sequence[str], upper: str, work: str, target: str) -> None:
    options = f"lowerdir={':'.join(lower)},upperdir={upper},workdir={work}".encode()
    if _libc.mount(b"overlay", target.encode(), b"overlay", 0, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t overlay on {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


@functools.cache
def overlay_supported() -> bool:
    """True when this process may mount overlayfs (probed once with a throw-away mount)."""
    if os.geteuid() != 0:
        return False
    root = tempfile.mkdtemp(prefix="bpo-swe-probe-")
    try:
        dirs = [os.path.join(root, n) for n in ("lower", "upper", "work", "merged")]
        for d in dirs:
            os.mkdir(d)
        try:
            _mount_overlay([dirs[0]], dirs[1], dirs[2], dirs[3])
        except OSError:
            return False
        _umount(dirs[3])
        return True
    finally:
        shutil.rmtree(root, ignore_errors=True)


class OverlayWorkspace(Workspace):
    """overlayfs-backed workspace; see the module docstring.

    Args:
        uid: owner of the writable upper dir (and of copied-up files).
        max_layers: stack depth above which a snapshot flattens the stack into one layer.
    """

    def __init__(self, uid: int | None, max_layers: int = 24, disk: QuotaDisk | None = None) -> None:
        super().__init__(uid, disk)
        self.max_layers = max_layers
        self._upper = os.path.join(self._root, "upper")
        self._work = os.path.join(self._root, "work")
        self._stack: tuple[Layer, ...] = ()  # top first; the origin is always last
        self._mounted = False

    def _mount(self, stack: Sequence[Layer]) -> None:
        for d in (self._upper, self._work):
            shutil.rmtree(d, ignore_errors=True)
            os.mkdir(d)
        if self.uid is not None:
            os.chown(self._upper, self.uid, self.uid)
        for layer in stack:
            layer.acquire()
        _release_all(self._stack)
        self._stack = tuple(stack)
        _mount_overlay([layer.path for layer in stack], self._upper, self._work, self.path)
        self._mounted = True
        with self._mirrors_lock:
            self._bind_mirrors()

    def _unmount(self) -> None:
        if self._mounted:
            with self._mirrors_lock:
                self._unbind_mirrors()
            _umount(self.path)
            self._mounted = False

    def _shown(self) -> bool:
        return self._mounted

    def _load(self, origin: Layer) -> None:
        self._unmount()
        self._mount([origin])

    def _snapshot(self) -> _State:
        if not os.listdir(self._upper):  # nothing changed since the last snapshot/restore: share its stack
            return _State(self._stack)
        self._unmount()
        layer = Layer(self.disk)  # on the upper's filesystem; no reference yet: the remount takes the workspace's
        os.rename(self._upper, layer.path)
        self._mount((layer, *self._stack))
        if len(self._stack) > self.max_layers:
            flat = make_layer(self.path, self.uid)
            self._unmount()
            self._mount((flat, self._stack[-1]))
        return _State(self._stack)

    def _restore(self, state: _State) -> None:
        if state.files is not None:
            raise TypeError("snapshot is an in-memory file copy, not an overlay layer stack")
        self._unmount()
        self._mount(state.layers)

    def _close(self) -> None:
        self._unmount()
        _release_all(self._stack)
        self._stack = ()


# ---------------------------------------------------------------------------------------------------------------
# in-memory copy


@dataclasses.dataclass(frozen=True)
class _OriginFile:
    """Recorded file content: the bytes of the origin layer's file at ``path`` (held on disk, not in memory)."""

    path: str


# (size, inode, mtime, ctime, link count): a file whose signature is unchanged has unchanged content. The kernel
# gives a file that was stat'ed since its last change a fine-grained change time on its next change.
_Signature = tuple[int, int, int, int, int]


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)


def _scan(root: str) -> dict[str, tuple[str, int, Any]]:
    """path -> (kind, mode, detail) for every entry under ``root`` in walk order (parents first), without reading
    file contents. Kinds: ``file`` (detail = signature), ``dir``, ``link`` (detail = target; never followed) and
    ``other`` (fifos, sockets, devices: not part of a repository; snapshots drop them, restores delete them)."""
    entries: dict[str, tuple[str, int, Any]] = {}

    def walk(rel: str) -> None:
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in sorted(it, key=lambda e: e.name):
                path = os.path.join(rel, entry.name) if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISLNK(st.st_mode):
                    entries[path] = ("link", 0, os.readlink(entry.path))
                elif stat.S_ISDIR(st.st_mode):
                    entries[path] = ("dir", mode, None)
                    walk(path)
                elif stat.S_ISREG(st.st_mode):
                    entries[path] = ("file", mode, _signature(st))
                else:
                    entries[path] = ("other", mode, None)

    walk("")
    return entries


def _read_file(path: str) -> bytes:
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
        return f.read()


class MemoryWorkspace(Workspace):
    """Workspace whose snapshots are in-memory records of the directory; see the module docstring.

    Args:
        uid, disk: as for :class:`Workspace`.
        max_snapshot_bytes: most bytes of changed file contents one snapshot may hold (default 256 MiB); a larger
            snapshot raises :class:`SnapshotTooLarge` (the sampler then does not fork that node).
    """

    def __init__(self, uid: int | None, disk: QuotaDisk | None = None, max_snapshot_bytes: int = 256 << 20) -> None:
        super().__init__(uid, disk)
        self.max_snapshot_bytes = max_snapshot_bytes
        # path -> (signature, content) of files whose content is known: bytes or an _OriginFile
        self._known: dict[str, tuple[_Signature, bytes | _OriginFile]] = {}

    def _load(self, origin: Layer) -> None:
        self._sync(((path, kind, mode, _OriginFile(path) if kind == "file" else detail)
                    for path, (kind, mode, detail) in _scan(origin.path).items() if kind != "other"), origin)

    def _snapshot(self) -> _State:
        entries, held = [], 0
        for path, (kind, mode, detail) in _scan(self.path).items():
            if kind == "other":
                continue
            if kind == "file":
                known = self._known.get(path)
                if known is not None and known[0] == detail and detail[4] == 1:
                    content = known[1]
                else:  # changed (or hard-linked: another name may change it) since it was last known
                    content = _read_file(os.path.join(self.path, path))
                    self._known[path] = (detail, content)
                if isinstance(content, bytes):
                    held += len(content)
                detail = content
            entries.append((path, kind, mode, detail))
        if held > self.max_snapshot_bytes:
            raise SnapshotTooLarge(f"swebench: a memory snapshot would hold {held} bytes of changed files, more "
                                   f"than max_snapshot_bytes={self.max_snapshot_bytes}")
        return _State([self.origin], tuple(entries))

    def _restore(self, state: _State) -> None:
        if state.files is None:
            raise TypeError("snapshot holds no file copy (it was made by an overlay workspace)")
        self._sync(state.files, state.layers[-1])

    def _sync(self, entries: Any, origin: Layer) -> None:
        """Make the directory hold exactly ``entries``, rewriting only what differs.

        Never follows a symlink: entries are fixed parents first, so every directory a file is written into is a
        real directory by then, and files are replaced (unlink + exclusive create), not written through. Hard
        links are broken too (snapshots do not record them), so a later write to one name cannot change another.
        """
        entries = tuple(entries)
        root, uid = self.path, self.uid
        current = _scan(root)
        wanted = {path: kind for path, kind, _, _ in entries}
        gone: set[str] = set()
        for path in sorted(current, reverse=True):  # children sort after their parent: delete them first
            kind = current[path][0]
            if wanted.get(path) != kind:
                target = os.path.join(root, path)
                shutil.rmtree(target) if kind == "dir" else os.unlink(target)
                gone.add(path)
                self._known.pop(path, None)
        created: set[str] = set()
        for path, kind, _mode, data in entries:
            target = os.path.join(root, path)
            present = path in current and path not in gone
            if kind == "dir":
                if present:
                    continue
                os.mkdir(target, 0o700)
            elif kind == "file":
                known = self._known.get(path)
                if present and known is not None and known[0] == current[path][2] and current[path][2][4] == 1 and (
                        known[1] is data or known[1] == data):
                    continue
                if present:
                    os.unlink(target)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    if isinstance(data, _OriginFile):
                        with open(os.path.join(origin.path, data.path), "rb") as source:
                            shutil.copyfileobj(source, f, 1 << 20)
                    else:
                        f.write(data)
            else:
                if present and current[path][2] == data:
                    continue
                if present:
                    os.unlink(target)
                os.symlink(data, target)
            created.add(path)
            if uid is not None:
                os.lchown(target, uid, uid)
        for path, kind, mode, _ in reversed(entries):  # modes last, children first: a read-only dir is filled first
            if kind != "link" and (path in created or current[path][1] != mode):
                os.chmod(os.path.join(root, path), mode)
        os.chmod(root, 0o755)
        if uid is not None:
            os.lchown(root, uid, uid)
        # what the directory now holds is known: the next snapshot reads nothing it did not change
        for path, kind, _mode, data in entries:
            if kind == "file":
                self._known[path] = (_signature(os.lstat(os.path.join(root, path))), data)

    def _close(self) -> None:
        self._known.clear()
        shutil.rmtree(self.path, ignore_errors=True)
