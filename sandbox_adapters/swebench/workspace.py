"""Snapshot-able workspace directories for the SWE sandbox: overlayfs layers or an in-memory copy of the files.

The agent's state is a directory (plus a cwd the adapter keeps), so a snapshot of the directory is exact. Two
backends with one interface (:class:`Workspace`):

* :class:`OverlayWorkspace` (``mount -t overlay``, root only): the directory is an overlay of read-only *layers*
  under one writable upper dir. ``snapshot()`` unmounts, turns the upper dir into a new read-only layer and mounts
  again on a fresh upper (a few ms, independent of repository size); ``restore()`` remounts the snapshot's layer
  stack under an empty upper. Layers are reference-counted directories shared by the sandbox and every snapshot
  that uses them; a layer is deleted when its last user lets go. Deep stacks are flattened into one layer
  (``max_layers``) to stay far below the kernel's limit on mount options.
* :class:`MemoryWorkspace` (portable): ``snapshot()`` reads every file, directory and symlink into an immutable
  tuple; ``restore()`` compares the directory with it and rewrites only what differs. Cost grows with repository
  size (every file is read); fine for the small generated repositories.

Both also keep the task's pristine checkout (the *origin* layer) that grading copies, and hand it to any sandbox
that restores one of their snapshots. Host-side code never follows a symlink the agent created: the memory backend
records symlinks as links, fixes parents before children and replaces files instead of writing through them, and
the overlay backend only renames, copies (``cp -a``) and mounts.
"""

from __future__ import annotations

import abc
import ctypes
import functools
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence

from sandbox_adapters.swebench.confine import chown_tree

__all__ = ["Layer", "Workspace", "OverlayWorkspace", "MemoryWorkspace", "overlay_supported", "make_layer"]

_LOCK = threading.Lock()
_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------------------------------------------------------
# Layers: reference-counted read-only directories


class Layer:
    """A read-only directory tree (``self.path``) that lives in its own temp dir until its last reference goes."""

    def __init__(self) -> None:
        self._root = tempfile.mkdtemp(prefix="bpo-swe-layer-")
        self.path = os.path.join(self._root, "d")
        self._refs = 0

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
    """

    def __init__(self, uid: int | None) -> None:
        self.uid = uid
        self._root = tempfile.mkdtemp(prefix="bpo-swe-ws-")
        self.path = os.path.join(self._root, "merged")
        os.mkdir(self.path)
        self.origin: Layer | None = None

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
        self._close()
        if self.origin is not None:
            self.origin.release()
            self.origin = None
        shutil.rmtree(self._root, ignore_errors=True)

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

    def __init__(self, uid: int | None, max_layers: int = 24) -> None:
        super().__init__(uid)
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

    def _unmount(self) -> None:
        if self._mounted:
            _umount(self.path)
            self._mounted = False

    def _load(self, origin: Layer) -> None:
        self._unmount()
        self._mount([origin])

    def _snapshot(self) -> _State:
        if not os.listdir(self._upper):  # nothing changed since the last snapshot/restore: share its stack
            return _State(self._stack)
        self._unmount()
        layer = Layer()  # no reference yet: the remount below takes the workspace's
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


def _scan(root: str) -> dict[str, tuple[str, int, bytes | str | None, int]]:
    """path -> (kind, mode, data, link count) for every entry under ``root`` in walk order (parents first).

    Kinds: ``file`` (data = bytes), ``dir``, ``link`` (data = target; never followed) and ``other`` (fifos,
    sockets, device nodes: not part of a repository, so snapshots drop them and restores delete them).
    """
    entries: dict[str, tuple[str, int, bytes | str | None, int]] = {}

    def walk(rel: str) -> None:
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in sorted(it, key=lambda e: e.name):
                path = os.path.join(rel, entry.name) if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISLNK(st.st_mode):
                    entries[path] = ("link", 0, os.readlink(entry.path), 1)
                elif stat.S_ISDIR(st.st_mode):
                    entries[path] = ("dir", mode, None, 1)
                    walk(path)
                elif stat.S_ISREG(st.st_mode):
                    with open(entry.path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
                        entries[path] = ("file", mode, f.read(), st.st_nlink)
                else:
                    entries[path] = ("other", mode, None, 1)

    walk("")
    return entries


def _read_tree(root: str) -> tuple:
    """The snapshot of ``root``: (path, kind, mode, data) per file, directory and symlink, parents first."""
    return tuple((path, kind, mode, data) for path, (kind, mode, data, _) in _scan(root).items() if kind != "other")


def _sync_tree(root: str, entries: tuple, uid: int | None) -> None:
    """Make ``root`` hold exactly ``entries``, rewriting only what differs.

    Never follows a symlink: entries are fixed parents first, so every directory a file is written into is a real
    directory by then, and files are replaced (unlink + exclusive create), not written through. Hard links are
    broken too (snapshots do not record them), so a later write to one name cannot change another.
    """
    current = _scan(root)
    wanted = {path: (kind, mode, data) for path, kind, mode, data in entries}
    gone: set[str] = set()
    for path in sorted(current, reverse=True):  # children sort after their parent: delete them first
        kind = current[path][0]
        if wanted.get(path, (None,))[0] != kind:
            target = os.path.join(root, path)
            shutil.rmtree(target) if kind == "dir" else os.unlink(target)
            gone.add(path)
    created: set[str] = set()
    for path, kind, _mode, data in entries:
        target = os.path.join(root, path)
        present = path in current and path not in gone
        if kind == "dir":
            if present:
                continue
            os.mkdir(target, 0o700)
        elif kind == "file":
            if present and current[path][2] == data and current[path][3] == 1:
                continue
            if present:
                os.unlink(target)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
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


class MemoryWorkspace(Workspace):
    """Workspace whose snapshots are in-memory copies of every file; see the module docstring."""

    def _load(self, origin: Layer) -> None:
        _sync_tree(self.path, _read_tree(origin.path), self.uid)

    def _snapshot(self) -> _State:
        return _State([self.origin], _read_tree(self.path))

    def _restore(self, state: _State) -> None:
        if state.files is None:
            raise TypeError("snapshot holds no file copy (it was made by an overlay workspace)")
        _sync_tree(self.path, state.files, self.uid)

    def _close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
