"""Process confinement for the SWE sandbox: run one shell script with no network, a read-only host and limits.

Every command the agent sends (and every git or grading step that reads agent-written files) runs as::

    bwrap <new root> -- prlimit <limits> -- setpriv <drop to an unprivileged uid> -- bash -c <script>

* **bubblewrap** (Debian package ``bubblewrap``) builds a new root from read-only binds of the host's system
  directories (``SYSTEM_DIRS``) and the interpreter's directories only, fresh ``/proc``, ``/dev`` and an empty
  ``/tmp`` tmpfs, and binds exactly one writable directory, the workspace, at a fixed path (``/testbed`` as in
  SWE-bench images). The rest of the host, task data included, is not visible. It unshares the network (only a
  down loopback exists), the pid namespace (killing bubblewrap kills every process the command started, daemons
  included) and IPC/UTS. A write to a system directory fails with "Read-only file system", anywhere else outside
  the workspace and the throw-away ``/tmp`` with "No such file or directory".
* **the sandbox's cgroup** (``limits.Cgroup``, when given): every command starts inside it, so memory, processes
  and CPU are limited for all processes of the sandbox together, and :meth:`Confinement.kill_all` can stop every
  one of them. ``/tmp`` is a tmpfs of ``Budget.tmp_bytes``, charged to that memory budget.
* **prlimit** (util-linux) sets per-process address space, file size and open-file limits (and, only without a
  cgroup, the process count). It is used rather than ``preexec_fn``, which is unsafe in the multi-threaded
  processes (Ray, torch) this code runs in.
* **setpriv** (util-linux) drops root to ``uid``; the workspace is chowned to that uid by the caller. Without a
  cgroup, the fork-bomb limit is ``RLIMIT_NPROC``, which the kernel ignores for root and counts over all
  processes of the uid.
* A wall-clock timeout kills bubblewrap's process group (the pid namespace takes every descendant down with it)
  and everything in the cgroup.

The Python interpreter's directories (``sys.prefix``, ``sys.base_prefix``) are made visible, also when they sit
under a directory other users cannot enter (pyenv under a 0700 ``/root``), so the unprivileged uid can run the
same ``python``/``pytest`` as the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence

from sandbox_adapters.swebench.limits import Cgroup

__all__ = [
    "Limits", "RunResult", "Confinement", "ConfinementUnavailable", "chown_tree", "deterministic_env", "bwrap_path",
]

#: Host top-level directories every command sees, read-only: programs, libraries and system configuration.
#: Everything else (home directories, /work, /srv, /opt, /var, ...) is invisible unless named in ``ro_paths``, so
#: an agent cannot read the task data (gold patches, hidden tests) or anything else of the host.
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc")


class ConfinementUnavailable(RuntimeError):
    """bubblewrap, prlimit or setpriv is missing, so commands cannot be confined."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one confined command.

    Attributes:
        timeout_s: wall-clock seconds before the command and all its processes are killed.
        memory_bytes: address-space limit of each process (``RLIMIT_AS``).
        max_processes: process/thread limit of the sandbox uid (``RLIMIT_NPROC``; stops fork bombs).
        max_file_bytes: largest file a process may write (``RLIMIT_FSIZE``; also bounds the captured output).
        max_open_files: open file descriptors per process (``RLIMIT_NOFILE``).
        tmp_bytes: size of the command's private ``/tmp`` (a tmpfs).
    """

    timeout_s: float = 30.0
    memory_bytes: int = 2 << 30
    max_processes: int = 64
    max_file_bytes: int = 64 << 20
    max_open_files: int = 256
    tmp_bytes: int = 256 << 20


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Outcome of one confined command.

    Attributes:
        output: stdout and stderr interleaved, at most ``max_output_bytes`` of it.
        returncode: the script's exit status; ``None`` when it was killed by the timeout.
        timed_out: True when the wall-clock limit killed it.
        truncated: True when the output was longer than ``max_output_bytes``.
        cwd: what the script reported through the cwd channel (``None`` when it reported nothing).
    """

    output: bytes
    returncode: int | None
    timed_out: bool
    truncated: bool
    cwd: str | None


def bwrap_path() -> str | None:
    """Path of the bubblewrap binary, or None when it is not installed."""
    return shutil.which("bwrap")


def deterministic_env(path_prefix: Sequence[str] = ()) -> dict[str, str]:
    """The whole environment of a confined command: fixed locale, time zone, hash seed and git identity/dates.

    Nothing is inherited from the host, so two runs of the same command in the same files print the same bytes
    (timing strings aside, which the adapter normalises).
    """
    path = ":".join([*path_prefix, "/usr/local/bin", "/usr/bin", "/bin"])
    fixed_date = "2024-01-01T00:00:00+0000"
    return {
        "PATH": path,
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "TERM": "dumb",
        "COLUMNS": "100",
        "LINES": "40",
        "NO_COLOR": "1",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        # pytest's cache dir would otherwise appear in the repo and in the agent's diff
        "PYTEST_ADDOPTS": "-p no:cacheprovider",
        # the host's installed pytest plugins would change what tests print and slow every run down
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        # GNU ls prints no clock times, which differ between a branch and its replay
        "TIME_STYLE": "+-",
        # commits made by the agent get fixed hashes, so branches that commit the same change stay identical
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "agent",
        "GIT_AUTHOR_EMAIL": "agent@sandbox.invalid",
        "GIT_COMMITTER_NAME": "agent",
        "GIT_COMMITTER_EMAIL": "agent@sandbox.invalid",
        "GIT_AUTHOR_DATE": fixed_date,
        "GIT_COMMITTER_DATE": fixed_date,
    }


def _root_args(ro_paths: Iterable[str]) -> list[str]:
    """bwrap arguments that build the visible host: ``SYSTEM_DIRS`` plus each of ``ro_paths``, all read-only.

    The directories on the way to a path are created in the new root, world-traversable (bwrap would make them
    0700), so the unprivileged uid reaches the path even where the host's ancestor is private (pyenv under a 0700
    ``/root``) while nothing else of that ancestor is visible.
    """
    args: list[str] = []
    visible: list[str] = []
    for entry in SYSTEM_DIRS:
        path = "/" + entry
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            visible.append(path)
    bound: list[str] = []
    made: set[str] = set()
    for path in sorted({os.path.realpath(p) for p in ro_paths if os.path.exists(p)}):
        if any(path == b or path.startswith(b + "/") for b in (*visible, *bound)):
            continue  # already visible (the system dirs keep the host's permissions)
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            directory = "/" + "/".join(parts[:i])
            if directory not in made:
                args += ["--perms", "0755", "--dir", directory]
                made.add(directory)
        args += ["--ro-bind", path, path]
        bound.append(path)
    return args


def _interpreter_paths() -> list[str]:
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    return [sys.prefix, sys.base_prefix, exe_dir]


class Confinement:
    """Runs scripts confined to one workspace directory; see the module docstring for the mechanisms.

    Args:
        workspace: host directory bound writable at ``mount_point``.
        limits: resource limits of each command.
        uid: unprivileged uid (and gid) commands run as when this process is root.
        mount_point: where the workspace appears inside the sandbox.
        path_prefix: directories put first on ``PATH`` (the interpreter's ``bin``, so ``python``/``pytest`` work).
        extra_ro_paths: further host paths made readable inside (everything outside ``SYSTEM_DIRS`` and the
            interpreter is invisible otherwise).
        max_output_bytes: how much of the output is kept.
        cgroup: the sandbox's cgroup every command starts in (None: per-process limits only).
    """

    def __init__(
        self,
        workspace: str,
        limits: Limits,
        uid: int = 65534,
        mount_point: str = "/testbed",
        path_prefix: Sequence[str] = (),
        extra_ro_paths: Sequence[str] = (),
        max_output_bytes: int = 1 << 20,
        cgroup: Cgroup | None = None,
    ) -> None:
        bwrap, prlimit, setpriv = bwrap_path(), shutil.which("prlimit"), shutil.which("setpriv")
        missing = [n for n, p in (("bwrap (apt-get install bubblewrap)", bwrap), ("prlimit", prlimit),
                                  ("setpriv", setpriv)) if p is None]
        if missing:
            raise ConfinementUnavailable(f"cannot confine sandbox commands: missing {', '.join(missing)}")
        self.workspace = workspace
        self.limits = limits
        self.mount_point = mount_point
        self.max_output_bytes = max_output_bytes
        self.drop_to_uid = uid if os.geteuid() == 0 else None
        self.env = deterministic_env(path_prefix)
        self.cgroup = cgroup
        self._bwrap = bwrap
        self._prefix = self._build_prefix(bwrap, prlimit, setpriv, [*_interpreter_paths(), *extra_ro_paths])
        self._running: set[subprocess.Popen] = set()
        self._running_lock = threading.Lock()

    def _build_prefix(self, bwrap: str, prlimit: str, setpriv: str, ro_paths: Sequence[str]) -> list[str]:
        args = self.cgroup.prefix() if self.cgroup is not None else []
        args += [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname",
                 "sandbox", "--die-with-parent", "--new-session", "--tmpfs", "/"]
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(self.limits.tmp_bytes),
                 "--tmpfs", "/tmp"]
        args += _root_args(ro_paths)
        args += ["--bind", self.workspace, self.mount_point, "--chdir", self.mount_point, "--"]
        lim = self.limits
        # with a cgroup the process limit is the sandbox's (pids.max); RLIMIT_NPROC would count the whole uid
        nproc = [f"--nproc={lim.max_processes}"] if self.cgroup is None else []
        args += [prlimit, f"--as={lim.memory_bytes}", *nproc, f"--fsize={lim.max_file_bytes}",
                 f"--nofile={lim.max_open_files}", "--core=0", "--"]
        if self.drop_to_uid is not None:
            uid = str(self.drop_to_uid)
            args += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        return args

    def run(self, script: str, args: Sequence[str] = (), stdin: bytes | None = None,
            timeout_s: float | None = None, env: Mapping[str, str] | None = None) -> RunResult:
        """Run ``bash -c script bpo *args`` confined; the script may report a cwd by writing to ``$BPO_CWD_FD``.

        Raises ``OSError`` when the confinement itself cannot start (the adapter turns it into ``SandboxCrashed``).
        """
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        cwd_read, cwd_write = os.pipe()
        with tempfile.TemporaryFile(prefix="bpo-swe-out-") as out:
            try:
                full_env = {**self.env, **(env or {}), "BPO_CWD_FD": str(cwd_write)}
                proc = subprocess.Popen(
                    [*self._prefix, "/bin/bash", "-c", script, "bpo", *args],
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, env=full_env, pass_fds=(cwd_write,),
                    start_new_session=True, cwd="/",
                )
            except BaseException:
                os.close(cwd_read)
                raise
            finally:
                os.close(cwd_write)
            with self._running_lock:
                self._running.add(proc)
            timed_out = False
            try:
                proc.communicate(input=stdin, timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                self._kill(proc)
            except BaseException:
                self._kill(proc)
                os.close(cwd_read)
                raise
            finally:
                with self._running_lock:
                    self._running.discard(proc)
            os.set_blocking(cwd_read, False)
            try:
                reported = os.read(cwd_read, 4096).decode("utf-8", "replace").strip() or None
            except BlockingIOError:
                reported = None
            finally:
                os.close(cwd_read)
            out.seek(0)
            output = out.read(self.max_output_bytes + 1)
        truncated = len(output) > self.max_output_bytes
        return RunResult(
            output=output[: self.max_output_bytes],
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            truncated=truncated,
            cwd=reported,
        )

    def _kill(self, proc: subprocess.Popen) -> None:
        # bwrap leads its own process group; its death tears down the whole pid namespace, and the cgroup holds
        # whatever else the command started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        proc.wait()

    def kill_all(self) -> None:
        """Kill every running command of this confinement and every process in its cgroup, and wait for them;
        the commands' ``run`` calls return as timed out."""
        with self._running_lock:
            running = list(self._running)
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        for proc in running:
            proc.wait()


def chown_tree(root: str, uid: int | None) -> None:
    """Give every entry under ``root`` (symlinks themselves, not their targets) to ``uid``; no-op for None."""
    if uid is None:
        return
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.lchown(os.path.join(dirpath, name), uid, uid)
