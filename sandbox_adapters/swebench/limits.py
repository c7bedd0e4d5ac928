"""One resource budget per SWE sandbox: memory, processes, CPU (a cgroup) and disk (a size-limited filesystem).

Per-process limits (``prlimit``) do not bound a sandbox: three processes of 1.5 GiB each pass a 2 GiB address-space
limit, and ``RLIMIT_NPROC`` counts every process of a uid across all sandboxes. So each sandbox gets:

* :class:`Cgroup` — a control group of its own (cgroup v1 hierarchies ``memory``, ``pids``, ``cpu``, as on this
  project's machines, or the cgroup v2 unified hierarchy with those controllers). Every command of the sandbox
  (agent commands, git, grading) starts inside it, so all of its processes together are limited to
  ``memory_bytes`` (the kernel's OOM killer stops a process of that sandbox, and only of it, beyond it), to
  ``max_processes`` tasks and to ``cpus`` CPUs. :meth:`Cgroup.kill` stops every process in it, however it was
  started, which ``close()`` does before it deletes anything.
* :class:`QuotaDisk` — a sparse ext4 image of ``disk_bytes`` mounted through a loop device: the sandbox's writable
  directory (its overlay upper layer, or its whole file copy) lives there, so ``/testbed`` cannot take more than
  that from the host's disk. Mounting and formatting take about 10 ms.

Both need root (and a kernel with cgroups and loop devices); :func:`cgroups_available` and
:func:`quota_disks_available` probe for them once. The Docker backend gets the same budget from the container's
own cgroup (``--memory``, ``--pids-limit``, ``--cpus``) and mounts ``/testbed`` from a :class:`QuotaDisk` too.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid

__all__ = ["Budget", "Cgroup", "QuotaDisk", "cgroups_available", "quota_disks_available", "CGROUP_ENTER"]

_V1_CONTROLLERS = ("memory", "pids", "cpu")

#: ``sh -c CGROUP_ENTER sh <n> <procs file>... <command>...``: moves itself into each cgroup, then execs the command,
#: so the command and everything it starts are in the sandbox's cgroup from their first instruction.
CGROUP_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one sandbox may use, all its processes together.

    Attributes:
        memory_bytes: resident memory (RAM; swap is not granted on top), ``/tmp`` included.
        max_processes: processes and threads alive at once.
        cpus: CPU time as a number of CPUs (e.g. 1.0 = one core's worth; 0 = no CPU limit).
        disk_bytes: bytes the sandbox may write into its directory (``/testbed``).
        tmp_bytes: size of the sandbox's ``/tmp`` (memory-backed, so it counts towards ``memory_bytes`` too).
    """

    memory_bytes: int = 2 << 30
    max_processes: int = 128
    cpus: float = 1.0
    disk_bytes: int = 2 << 30
    tmp_bytes: int = 256 << 20


def _own_cgroup_path(controller: str | None) -> str:
    """This process's cgroup path in the hierarchy of ``controller`` (v1) or the unified one (None)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (controller is None and controllers == "") or (controller and controller in controllers.split(",")):
                return path
    return "/"


def _v2_root() -> str | None:
    """The cgroup v2 mount if it is the one holding memory, pids and cpu, else None."""
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            available = set(f.read().split())
    except OSError:
        return None
    return "/sys/fs/cgroup" if {"memory", "pids", "cpu"} <= available else None


class Cgroup:
    """A cgroup of one sandbox (see the module docstring); ``procs_files`` are what :data:`CGROUP_ENTER` writes.

    Raises ``OSError`` when cgroups cannot be made here.
    """

    def __init__(self, budget: Budget) -> None:
        name = f"bpo-swe-{uuid.uuid4().hex[:12]}"
        self.dirs: list[str] = []
        self._lock = threading.Lock()
        self._kill_file: str | None = None
        self._pids_dir = ""
        try:
            root = _v2_root()
            if root is not None:
                parent = root + _own_cgroup_path(None)
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +pids +cpu")
                path = os.path.join(parent, name)
                os.mkdir(path)
                self.dirs.append(path)
                self._write(path, "memory.max", budget.memory_bytes)
                self._write(path, "memory.swap.max", 0, optional=True)
                self._write(path, "pids.max", budget.max_processes)
                if budget.cpus > 0:
                    self._write(path, "cpu.max", f"{int(budget.cpus * 100_000)} 100000")
                self._kill_file = os.path.join(path, "cgroup.kill")
                self._pids_dir = path
            else:
                for controller in _V1_CONTROLLERS:
                    path = os.path.join("/sys/fs/cgroup", controller, _own_cgroup_path(controller).lstrip("/"), name)
                    os.mkdir(path)
                    self.dirs.append(path)
                memory, pids, cpu = self.dirs
                self._write(memory, "memory.limit_in_bytes", budget.memory_bytes)
                self._write(memory, "memory.memsw.limit_in_bytes", budget.memory_bytes, optional=True)
                self._write(pids, "pids.max", budget.max_processes)
                if budget.cpus > 0:
                    self._write(cpu, "cpu.cfs_period_us", 100_000)
                    self._write(cpu, "cpu.cfs_quota_us", int(budget.cpus * 100_000))
                self._pids_dir = pids
        except BaseException:
            self.remove()
            raise
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in self.dirs]
        self._max_processes = budget.max_processes

    @staticmethod
    def _write(directory: str, name: str, value: object, optional: bool = False) -> None:
        try:
            with open(os.path.join(directory, name), "w") as f:
                f.write(str(value))
        except OSError:
            if not optional:
                raise

    def prefix(self) -> list[str]:
        """The argv prefix that starts a command inside this cgroup."""
        return ["/bin/sh", "-c", CGROUP_ENTER, "sh", str(len(self.procs_files)), *self.procs_files]

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self._pids_dir, "cgroup.procs")) as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def memory_peak_bytes(self) -> int | None:
        """The most memory the cgroup used so far (None where the kernel does not say)."""
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            for directory in self.dirs:
                try:
                    with open(os.path.join(directory, name)) as f:
                        return int(f.read())
                except OSError:
                    continue
        return None

    def kill(self, timeout_s: float = 10.0, reopen: bool = True) -> None:
        """SIGKILL every process in the cgroup and wait until it is empty. New forks cannot escape: the process
        limit drops to 0 first (so a fork bomb cannot outrun the kill) and is put back afterwards if ``reopen``."""
        if not self._pids_dir:
            return
        with self._lock:
            self._write(self._pids_dir, "pids.max", 0, optional=True)
            if self._kill_file is not None:
                self._write(self._pids_dir, "cgroup.kill", 1, optional=True)
            deadline = time.monotonic() + timeout_s
            while (pids := self.pids()) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.005)
            if reopen:
                self._write(self._pids_dir, "pids.max", self._max_processes, optional=True)

    def remove(self) -> None:
        """Kill what is left and delete the cgroup."""
        if self.dirs:
            self.kill(reopen=False)
        for directory in reversed(self.dirs):
            for _ in range(100):  # a killed task leaves the cgroup a moment after it was reaped
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs = []


@functools.cache
def cgroups_available() -> bool:
    """True when this process can make a sandbox cgroup (probed once)."""
    if os.geteuid() != 0:
        return False
    try:
        Cgroup(Budget()).remove()
    except OSError:
        return False
    return True


class QuotaDisk:
    """A size-limited directory (``self.path``): an ext4 image of ``size_bytes`` on a loop device.

    Reference-counted: the sandbox holds one reference, and every snapshot layer that lives on the disk holds
    another, so the disk is unmounted and deleted when the last of them is released. Raises ``OSError`` (or
    ``subprocess.CalledProcessError``) when it cannot be made.
    """

    def __init__(self, size_bytes: int, parent_dir: str | None = None) -> None:
        self._root = tempfile.mkdtemp(prefix="bpo-swe-disk-", dir=parent_dir)
        self.path = os.path.join(self._root, "mnt")
        image = os.path.join(self._root, "disk.img")
        self._refs = 1
        self._lock = threading.Lock()
        try:
            os.mkdir(self.path)
            with open(image, "wb") as f:
                f.truncate(max(size_bytes, 16 << 20))  # sparse: costs host disk only as it fills
            subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0",
                            "-E", "lazy_itable_init=1,nodiscard", image], check=True, capture_output=True)
            subprocess.run(["mount", "-o", "loop,nosuid,nodev", image, self.path], check=True, capture_output=True)
            os.chmod(self.path, 0o755)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise
        os.unlink(image)  # the loop device keeps it open; the space returns to the host once it is detached

    def acquire(self) -> QuotaDisk:
        with self._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            # the loop device detaches itself when unmounted (mount -o loop sets autoclear)
            subprocess.run(["umount", "-l", self.path], capture_output=True)
            shutil.rmtree(self._root, ignore_errors=True)


@functools.cache
def quota_disks_available() -> bool:
    """True when this process can make a :class:`QuotaDisk` (root, ``mkfs.ext4``, loop devices; probed once)."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        return False
    try:
        QuotaDisk(16 << 20).release()
    except (OSError, subprocess.CalledProcessError):
        return False
    return True
