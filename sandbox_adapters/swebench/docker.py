"""Run SWE sandbox commands in an instance's Docker image (SWE-bench's ``swebench/sweb.eval.x86_64.<id>``).

The image provides the toolchain (its conda environment, compilers, the installed repository) and the pristine
``/testbed``. The sandbox's own copy of ``/testbed`` lives on the host, in the same snapshot-able workspace as the
local backend (overlay layers or an in-memory record, on the sandbox's size-limited disk).

Each :class:`DockerRunner` uses one long-lived container, started at its first command::

    docker run -d --init --network none --read-only --tmpfs /tmp:size=<tmp_bytes> --shm-size <tmp_bytes>
        --memory <memory_bytes> --memory-swap <memory_bytes> --pids-limit <max_processes> --cpus <cpus>
        --cap-drop ALL --security-opt no-new-privileges --user 0:0
        --mount type=bind,src=<door>,dst=/testbed,bind-propagation=rslave <image> sleep infinity

and runs every command in it as ``docker exec -u <uid> -w /testbed <container> bash -c <wrapper> ...`` (through
the engine's API on its unix socket where that is the daemon the client talks to, which saves starting the client
for every command; else with the client). So there is no network (the daemon itself runs with ``--bridge=none
--iptables=false``), the root file system outside ``/testbed``, ``/tmp`` and ``/dev/shm`` is read-only, and
memory, processes and CPU are limited for all commands of the sandbox together (the container's cgroup). Every folder a command can write has a size: ``/testbed`` the
sandbox's disk, ``/tmp`` and ``/dev/shm`` their tmpfs size (inside the memory budget), ``/dev/mqueue`` the uid's
``RLIMIT_MSGQUEUE``; a command's output and its cwd report travel through pipes of which the host keeps a bounded
prefix, so nothing a command writes reaches the host's disk.

Nothing but ``/testbed`` carries over from one command to the next, which keeps a snapshot of the directory exact:

* the keeper (``docker-init`` and ``sleep infinity``) runs as root with no capabilities, so the sandbox uid can
  neither signal it nor stop the container; the uid cannot signal anything outside its own processes either;
* the wrapper (``_WRAPPER``) empties ``/tmp``, ``/dev/shm``, ``/dev/mqueue`` and System V IPC before the command
  and kills every process of the uid after it (background jobs, ``setsid``/``nohup`` daemons);
* then the host checks the container's cgroup and SIGKILLs whatever is still there but the keeper (with the
  cgroup's process limit closed meanwhile, so a fork bomb cannot outrun it): a daemon that escaped, or everything
  when the command was killed by its time limit or the wrapper itself was killed. The container goes on; only a
  container that cannot be cleaned or cannot run a command any more is replaced by a fresh one.

Whether a command ran at all is told by a line the wrapper writes to the exec's stderr before any of the agent's
code runs, not by a file: nothing a command does (deleting files, killing its shell, closing or flooding its
streams) can turn its step into an infrastructure fault. ``run`` raises ``OSError`` only when Docker cannot run
the command in a fresh container either.

The workspace reaches the container through a *door*: a host directory made a shared mount point, bound at
``/testbed`` as a slave mount. The workspace is bind-mounted onto the door (:meth:`Workspace.add_mirror
<sandbox_adapters.swebench.workspace.Workspace.add_mirror>`, which rebinds it after every overlay remount of a
snapshot or restore), and the mount propagates into the running container. So forks stay independent (each
sandbox has its own container and workspace), and a clean container, once its runner lets go, serves the next
runner of the same image and flags (``idle_containers``; at most ``_MAX_IDLE``, removed at exit), which makes a
fresh sandbox's first step as cheap as any other. Without root (no mounts) the workspace is bound directly and
containers are not reused.

:class:`DockerRunner` has the same ``run`` interface as :class:`~sandbox_adapters.swebench.confine.Confinement`,
so the adapter and the grading code use either. :func:`testbed_layer` extracts an image's ``/testbed`` once into a
cache directory keyed by the image id (``docker create`` + ``docker cp``), owned by the sandbox uid; the workspaces
of every sandbox of that image stack on it. :func:`build_instance_image` makes a small instance image from a
generated task on a base image made without any registry (``scripts/setup.sh`` builds one with ``debootstrap``
and ``docker import``), for tests and CI.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence

from sandbox_adapters.swebench.confine import Limits, RunResult, chown_tree, deterministic_env
from sandbox_adapters.swebench.workspace import Layer, bind_mount, detach_mount

__all__ = ["DockerRunner", "DockerUnavailable", "docker_available", "testbed_layer", "image_env",
           "build_instance_image", "instance_image_name", "idle_containers", "remove_idle_containers", "reap_orphans"]


class DockerUnavailable(RuntimeError):
    """No Docker engine answers, or an image is missing."""


def _docker(binary: str, *args: str, timeout_s: float = 120.0, stdin: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run([binary, *args], input=stdin, capture_output=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise DockerUnavailable(f"no docker client {binary!r} (Debian: apt-get install docker.io)") from exc
    if check and done.returncode != 0:
        raise DockerUnavailable(f"docker {' '.join(args[:2])} failed: {done.stderr.decode(errors='replace')[-800:]}")
    return done


@functools.cache
def docker_available(binary: str = "docker") -> bool:
    """True when a Docker engine answers ``docker info`` (probed once)."""
    try:
        return _docker(binary, "info", "--format", "{{.ServerVersion}}", timeout_s=20, check=False).returncode == 0
    except (DockerUnavailable, subprocess.TimeoutExpired):
        return False


def instance_image_name(instance: Mapping[str, object], namespace: str = "swebench") -> str:
    """The image of an instance: its ``image`` field, else the name the SWE-bench harness derives from its id."""
    image = instance.get("image")
    if isinstance(image, str) and image and image != "local":
        return image
    from swebench.task.checks import expected_image

    return expected_image(str(instance["instance_id"]), namespace)


@functools.cache
def _image_config(binary: str, image: str) -> tuple[str, tuple[str, ...]]:
    done = _docker(binary, "image", "inspect", "--format", "{{.Id}} {{json .Config.Env}}", image, check=False)
    if done.returncode != 0:
        raise DockerUnavailable(f"docker image {image!r} is not on this machine (build or load it first; this "
                                "project never pulls from a registry)")
    image_id, _, env = done.stdout.decode().strip().partition(" ")
    return image_id, tuple(json.loads(env) or ())


def image_env(binary: str, image: str) -> dict[str, str]:
    """The image's own environment (``ENV`` lines: ``PATH`` with its conda environment, ...)."""
    return dict(item.split("=", 1) for item in _image_config(binary, image)[1] if "=" in item)


_EXTRACT_LOCK = threading.Lock()


class _CachedLayer(Layer):
    """A layer that is a cache directory: references are counted, but it is never deleted."""

    def __init__(self, path: str) -> None:  # noqa: D107 - no temp dir of its own
        self._root = path
        self.path = path
        self._refs = 0
        self._disk = None

    def release(self) -> None:
        pass


def testbed_layer(image: str, uid: int | None, cache_dir: str, binary: str = "docker") -> Layer:
    """The image's ``/testbed`` as a read-only layer, extracted once per image id and uid into ``cache_dir``."""
    image_id = _image_config(binary, image)[0].replace("sha256:", "")
    target = os.path.join(cache_dir, f"{image_id[:32]}-uid{uid if uid is not None else 'own'}", "testbed")
    with _EXTRACT_LOCK:
        if not os.path.isdir(target):
            os.makedirs(os.path.dirname(os.path.dirname(target)), exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".extract-", dir=os.path.dirname(os.path.dirname(target)))
            name = f"bpo-swe-extract-{uuid.uuid4().hex[:12]}"
            try:
                _docker(binary, "create", "--name", name, "--network", "none", image, "true")
                try:
                    tar = _docker(binary, "cp", f"{name}:/testbed", "-", timeout_s=1800).stdout
                finally:
                    _docker(binary, "rm", "-f", name, check=False)
                subprocess.run(["tar", "-x", "-C", staging], input=tar, check=True, capture_output=True)
                chown_tree(os.path.join(staging, "testbed"), uid)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.rename(os.path.join(staging, "testbed"), target)  # atomic: a half extraction is never used
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return _CachedLayer(target)


#: The script every command runs in (``bash -c _WRAPPER bpo <script> <args>...``, as the sandbox uid). It says
#: that it started on its stderr before anything of the agent runs (so nothing the agent does can fake or hide
#: it), empties what an earlier command may have left in ``/tmp``, ``/dev/shm``, ``/dev/mqueue`` and System V IPC,
#: runs the script with stderr joined to stdout and fd 3 (the cwd channel) on the exec's stderr, then kills every
#: process of the uid but itself (background jobs, daemons: the keeper runs as root and is out of reach; without a
#: uid of their own, commands share the keeper's user, and only the host's sweep is left).
_WRAPPER = r"""
printf '%s\n' bpo-started >&2
shopt -s dotglob nullglob
left=(/tmp/* /dev/shm/* /dev/mqueue/*)
if ((${#left[@]})); then
    # directories the command locked (chmod 000) are opened first; find never follows a symlink out of here
    find "${left[@]}" -type d ! -perm -u+rwx -exec chmod u+rwx {} \; 2>/dev/null
    rm -rf -- "${left[@]}" 2>/dev/null
fi
shopt -u dotglob nullglob
for kind in shm msg sem; do
    { read -r _; read -r row; } < /proc/sysvipc/$kind 2>/dev/null
    [ -n "$row" ] && { ipcrm --all 2>/dev/null; break; }
done
script=$1 sweep=$BPO_SWEEP
shift
unset BPO_SWEEP
/bin/bash -c "$script" bpo "$@" 3>&2 2>&1
status=$?
[ -n "$sweep" ] && kill -9 -1 2>/dev/null
exit $status
"""
_STARTED = b"bpo-started\n"

#: Label of every sandbox container; its value is the pid of the process that made it.
CONTAINER_LABEL = "bpo-swe.owner"

#: Idle containers that may serve another runner with the same image and flags (see ``DockerRunner``).
_MAX_IDLE = 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@functools.cache
def reap_orphans(binary: str = "docker") -> int:
    """Remove the sandbox containers (and their door mounts) of processes that no longer run, once per process:
    a trainer killed outright (SIGKILL, or SIGTERM without handlers) runs no exit hook. Returns how many."""
    listed = _docker(binary, "ps", "-a", "--filter", f"label={CONTAINER_LABEL}", "--format",
                     f'{{{{.ID}}}} {{{{.Label "{CONTAINER_LABEL}"}}}}', check=False)
    reaped = 0
    for line in listed.stdout.decode().splitlines():
        cid, _, owner = line.partition(" ")
        if not owner.isdigit() or _alive(int(owner)):
            continue
        mounts = _docker(binary, "inspect", "--format", "{{range .Mounts}}{{.Source}}\n{{end}}", cid, check=False)
        _docker(binary, "rm", "-f", cid, check=False, timeout_s=60)
        for source in mounts.stdout.decode().split():
            root = os.path.dirname(source)
            if os.path.basename(root).startswith("bpo-swe-door-"):
                subprocess.run(["umount", "-l", source], capture_output=True)
                with contextlib.suppress(OSError):
                    os.rmdir(source)
                    os.rmdir(root)
        reaped += 1
    return reaped


def _pids_cgroup(pid: int) -> str | None:
    """The host directory of the pids cgroup of process ``pid`` (cgroup v1 or v2), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidate = os.path.join("/sys/fs/cgroup/pids", path.lstrip("/"))
            break
    else:
        candidate = next((os.path.join("/sys/fs/cgroup", line.split(":", 2)[2].lstrip("/")) for line in lines
                          if line.startswith("0::")), "")
    return candidate if candidate and os.path.exists(os.path.join(candidate, "cgroup.procs")) else None


class _Container:
    """One long-lived container: its idle keeper (``docker-init`` + ``sleep infinity`` as root) and the door.

    ``door`` is a shared mount point on the host that the container sees at ``/testbed`` as a slave mount, so a
    workspace bound onto it later (and rebound after each overlay remount) appears inside; None where this process
    cannot mount (then the workspace itself is bound and the container is never reused by another runner).
    """

    def __init__(self, binary: str, name: str, key: tuple, door: str | None) -> None:
        self.binary, self.name, self.key, self.door = binary, name, key, door
        self.pids_dir: str | None = None
        self.keepers: frozenset[int] = frozenset()
        self.max_processes = ""

    @classmethod
    def start(cls, binary: str, image: str, flags: Sequence[str], env: Mapping[str, str], mount_point: str,
              workspace: str | None, key: tuple) -> _Container:
        reap_orphans(binary)
        name = f"bpo-swe-{uuid.uuid4().hex}"
        door = None
        if workspace is None:
            door_root = tempfile.mkdtemp(prefix="bpo-swe-door-")
            door = os.path.join(door_root, "testbed")
            os.mkdir(door)
            try:
                bind_mount(door, door)
                subprocess.run(["mount", "--make-shared", door], check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError):
                subprocess.run(["umount", "-l", door], capture_output=True)
                with contextlib.suppress(OSError):
                    os.rmdir(door)
                    os.rmdir(door_root)
                raise
            source = f"type=bind,src={door},dst={mount_point},bind-propagation=rslave"
        else:
            source = f"type=bind,src={workspace},dst={mount_point}"
        self = cls(binary, name, key, door)
        command = [binary, "run", "-d", "--init", "--name", name, "--label", f"{CONTAINER_LABEL}={os.getpid()}",
                   *flags, "--mount", source, "-w", "/"]
        for k, value in env.items():
            command += ["-e", f"{k}={value}"]
        command += ["--entrypoint", "sleep", image, "infinity"]
        try:
            _docker(binary, *command[1:])
            pid = int(_docker(binary, "inspect", "--format", "{{.State.Pid}}", name).stdout.decode().strip() or 0)
            self.pids_dir = _pids_cgroup(pid) if pid else None
            if self.pids_dir is not None:
                # the keeper: docker-init and its sleep (the only processes until the first command)
                deadline = time.monotonic() + 5
                while len(keepers := self._procs()) < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.keepers = frozenset(keepers)
                with contextlib.suppress(OSError), open(os.path.join(self.pids_dir, "pids.max")) as f:
                    self.max_processes = f.read().strip()
                if len(keepers) < 2:  # the keeper cannot be told from a command's processes: sweep from inside
                    self.pids_dir = None
        except BaseException:
            self.remove()
            raise
        return self

    def _procs(self) -> set[int]:
        try:
            with open(os.path.join(self.pids_dir, "cgroup.procs")) as f:
                return {int(p) for p in f.read().split()}
        except (OSError, TypeError):
            return set()

    def sweep(self, timeout_s: float = 10.0) -> bool | None:
        """SIGKILL every process of the container but its keeper, from the host (the container's cgroup), and wait
        until they are gone. True when only the keeper is left, False when that failed, None where this process
        cannot see the cgroup."""
        if self.pids_dir is None:
            return None
        extra = self._procs() - self.keepers
        if not extra:
            return True
        start = time.monotonic()
        closed = False
        try:
            while extra and time.monotonic() - start < timeout_s:
                if not closed and time.monotonic() - start > 0.02:
                    # still there after a moment (not just exiting): no new processes, so a fork bomb cannot
                    # outrun the kill
                    with contextlib.suppress(OSError), open(os.path.join(self.pids_dir, "pids.max"), "w") as f:
                        f.write("1")
                    closed = True
                for pid in extra:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.001)
                extra = self._procs() - self.keepers
        finally:
            if closed and self.max_processes:
                with contextlib.suppress(OSError), open(os.path.join(self.pids_dir, "pids.max"), "w") as f:
                    f.write(self.max_processes)
        return not extra and self.keepers <= self._procs()

    def running(self) -> bool:
        if self.pids_dir is not None:
            return bool(self.keepers) and self.keepers <= self._procs()
        done = _docker(self.binary, "inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return done.returncode == 0 and done.stdout.strip() == b"true"

    def remove(self) -> None:
        _docker(self.binary, "rm", "-f", self.name, check=False, timeout_s=60)
        if self.door is not None:
            # a workspace still bound there (if its runner could not unbind it), then the door's own bind; only
            # empty directories are deleted, never what a mount may still show
            for _ in range(2):
                subprocess.run(["umount", "-l", self.door], capture_output=True)
            for directory in (self.door, os.path.dirname(self.door)):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            self.door = None


_IDLE: list[_Container] = []
_IDLE_LOCK = threading.Lock()
_EXITING = False


def _take_idle(key: tuple) -> _Container | None:
    with _IDLE_LOCK:
        for i, container in enumerate(_IDLE):
            if container.key == key:
                return _IDLE.pop(i)
    return None


def _give_back(container: _Container, reusable: bool) -> None:
    """Keep a clean container for the next runner of the same image and flags, else remove it."""
    if reusable and not _EXITING and container.door is not None and container.sweep() and container.running():
        with _IDLE_LOCK:
            if len(_IDLE) < _MAX_IDLE:
                _IDLE.append(container)
                return
    container.remove()


def idle_containers() -> list[str]:
    """Names of the clean containers kept for reuse (no process of any sandbox runs in them)."""
    with _IDLE_LOCK:
        return [c.name for c in _IDLE]


def remove_idle_containers() -> None:
    """Remove the containers kept for reuse (done at exit; call it to free their memory earlier)."""
    with _IDLE_LOCK:
        idle = list(_IDLE)
        _IDLE.clear()
    for container in idle:
        container.remove()


@atexit.register
def _at_exit() -> None:
    global _EXITING
    _EXITING = True  # runners released from now on (finalizers at exit) remove their containers
    remove_idle_containers()


class _Slot:
    """What a runner holds and must give back, also when it is dropped without ``kill_all``: its container and
    the workspace mirror that shows the workspace in it."""

    def __init__(self, workspace: object, reusable: bool) -> None:
        self.workspace, self.reusable = workspace, reusable
        self.container: _Container | None = None
        self.bound = False  # the workspace is shown at container.door

    def attach(self, container: _Container) -> None:
        self.container = container
        if container.door is None:
            return
        if hasattr(self.workspace, "add_mirror"):
            self.workspace.add_mirror(container.door)
        else:
            bind_mount(self.workspace, container.door)
        self.bound = True

    def release(self, reusable: bool | None = None) -> None:
        container, self.container = self.container, None
        if container is None:
            return
        if self.bound:
            self.bound = False
            try:
                if hasattr(self.workspace, "remove_mirror"):
                    self.workspace.remove_mirror(container.door)
                else:
                    detach_mount(container.door)
            except OSError:
                reusable = False
        _give_back(container, self.reusable if reusable is None else reusable and self.reusable)


def _reader(stream, keep: int, sink: list[bytes]) -> None:
    """Keep the first ``keep`` bytes of ``stream`` in ``sink`` and drain the rest (nothing reaches the disk)."""
    held = 0
    with contextlib.suppress(OSError, ValueError):
        while chunk := stream.read1(1 << 16):
            if held < keep:
                sink.append(chunk[: keep - held])
                held += len(sink[-1])
    with contextlib.suppress(OSError):
        stream.close()


def _writer(stream, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        stream.write(data)
    with contextlib.suppress(OSError, ValueError):
        stream.close()


class _CliExec:
    """A command run by ``docker exec`` (the client), with bounded prefixes of its stdout (``out``) and stderr."""

    def __init__(self, binary: str, container: str, argv: Sequence[str], user: str | None, workdir: str,
                 env: Mapping[str, str], stdin: bytes | None, keep: tuple[int, int]) -> None:
        command = [binary, "exec", *(["-i"] if stdin is not None else []), *(["-u", user] if user else []),
                   "-w", workdir]
        for key, value in env.items():
            command += ["-e", f"{key}={value}"]
        self.proc = subprocess.Popen([*command, container, *argv],
                                     stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self._threads = [threading.Thread(target=_reader, args=(self.proc.stdout, keep[0], self.out), daemon=True),
                         threading.Thread(target=_reader, args=(self.proc.stderr, keep[1], self.err), daemon=True)]
        if stdin is not None:  # a script that does not read its input must not block the caller
            self._threads.append(threading.Thread(target=_writer, args=(self.proc.stdin, stdin), daemon=True))
        for thread in self._threads:
            thread.start()

    def wait(self, timeout: float | None) -> bool:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def abort(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self) -> int | None:
        self.proc.wait()
        for thread in self._threads:
            thread.join(5)
        return self.proc.returncode


class _ExecRefused(OSError):
    """The engine did not start the command (the container is gone or stopped, the exec failed)."""


def _api(socket_path: str, method: str, path: str, body: object = None, timeout_s: float = 60) -> tuple[int, bytes]:
    connection = _UnixHTTPConnection(socket_path, timeout_s)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._socket_path)


@functools.cache
def _api_socket(binary: str) -> str | None:
    """The engine's unix socket when it is the one the client talks to (the same daemon id), else None: commands
    then go through the API directly, which saves starting the client for every command."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://") or os.environ.get("DOCKER_CONTEXT"):
        return None
    path = host[len("unix://"):]
    try:
        status, data = _api(path, "GET", "/info", timeout_s=20)
        ours = json.loads(data).get("ID") if status == 200 else None
        theirs = _docker(binary, "info", "--format", "{{.ID}}", timeout_s=20, check=False).stdout.decode().strip()
    except (OSError, ValueError, DockerUnavailable, subprocess.TimeoutExpired):
        return None
    return path if ours and ours == theirs else None


class _ApiExec:
    """A command run through the engine's API (exec create + a hijacked exec start), with the interface of
    :class:`_CliExec`. Raises :class:`_ExecRefused` when the engine does not start it."""

    def __init__(self, socket_path: str, container: str, argv: Sequence[str], user: str | None, workdir: str,
                 env: Mapping[str, str], stdin: bytes | None, keep: tuple[int, int]) -> None:
        self._socket_path = socket_path
        spec = {"AttachStdin": stdin is not None, "AttachStdout": True, "AttachStderr": True, "Tty": False,
                "Cmd": list(argv), "WorkingDir": workdir, "Env": [f"{k}={v}" for k, v in env.items()]}
        if user:
            spec["User"] = user
        status, data = _api(socket_path, "POST", f"/containers/{container}/exec", spec)
        if status != 201:
            raise _ExecRefused(f"exec create: {status} {data[-800:].decode('utf-8', 'replace')}")
        self.id = json.loads(data)["Id"]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        body = json.dumps({"Detach": False, "Tty": False}).encode()
        self.sock.sendall(f"POST /exec/{self.id}/start HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json"
                          f"\r\nConnection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: {len(body)}\r\n\r\n"
                          .encode() + body)
        self._stream = self.sock.makefile("rb")
        status_line = self._stream.readline()
        while self._stream.readline() not in (b"\r\n", b"\n", b""):
            pass
        if status_line.split(b" ")[1:2] not in ([b"101"], [b"200"]):
            self.sock.close()
            raise _ExecRefused(f"exec start: {status_line.decode('utf-8', 'replace').strip()}")
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self._keep = keep
        self._threads = [threading.Thread(target=self._read, daemon=True)]
        if stdin is not None:
            self._threads.append(threading.Thread(target=self._write, args=(stdin,), daemon=True))
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        """Demultiplex the stream (8-byte frame headers: stream 1 stdout, 2 stderr) into bounded prefixes."""
        held = [0, 0]
        with contextlib.suppress(OSError, ValueError):
            while len(header := self._stream.read(8)) == 8:
                which = 1 if header[0] == 2 else 0
                size = int.from_bytes(header[4:], "big")
                while size > 0 and (chunk := self._stream.read(min(size, 1 << 16))):
                    size -= len(chunk)
                    if held[which] < self._keep[which]:
                        sink = self.err if which else self.out
                        sink.append(chunk[: self._keep[which] - held[which]])
                        held[which] += len(sink[-1])

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(data)
            self.sock.shutdown(socket.SHUT_WR)  # the command's stdin ends here

    def wait(self, timeout: float | None) -> bool:
        self._threads[0].join(timeout)
        return not self._threads[0].is_alive()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def finish(self) -> int | None:
        for thread in self._threads:
            thread.join(5)
        with contextlib.suppress(OSError):
            self._stream.close()
            self.sock.close()
        deadline = time.monotonic() + 5
        while True:  # the stream can end a moment before the engine records the exit status
            try:
                status, data = _api(self._socket_path, "GET", f"/exec/{self.id}/json", timeout_s=30)
                state = json.loads(data) if status == 200 else {}
            except (OSError, ValueError):
                state = {}
            if not state.get("Running") or time.monotonic() > deadline:
                code = state.get("ExitCode")
                return code if isinstance(code, int) else None
            time.sleep(0.002)


class DockerRunner:
    """Runs scripts in one long-lived container of ``image`` with the workspace at ``/testbed``; see the module
    docstring.

    Args:
        workspace: host directory bound writable at ``mount_point``, or a
            :class:`~sandbox_adapters.swebench.workspace.Workspace` (then its mirrors follow its remounts).
        image: the instance image.
        limits: per-command time, process file size and open files, plus the sandbox budget below.
        memory_bytes, max_processes, cpus: the container's cgroup limits.
        uid: user (and group) the commands run as; None: the image's user.
        mount_point: where the workspace appears (``/testbed`` in SWE-bench images).
        max_output_bytes: how much of the output is kept.
        binary: the docker client.
        read_only_root: mount the image's root file system read-only (``/testbed`` and ``/tmp`` stay writable);
            a container with a writable root is never reused.
    """

    def __init__(self, workspace: object, image: str, limits: Limits, *, memory_bytes: int, max_processes: int,
                 cpus: float, uid: int | None = 65534, mount_point: str = "/testbed",
                 max_output_bytes: int = 1 << 20, binary: str = "docker", read_only_root: bool = True) -> None:
        if not docker_available(binary):
            raise DockerUnavailable("no Docker engine answers (start one: dockerd --bridge=none --iptables=false)")
        self.workspace = getattr(workspace, "path", workspace)
        self.image, self.limits = image, limits
        self.mount_point, self.max_output_bytes, self.binary = mount_point, max_output_bytes, binary
        env = image_env(binary, image)
        fixed = deterministic_env()
        # the image's own PATH (its conda environment); its repository's pytest plugins load as in the harness
        fixed.pop("PATH")
        fixed.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
        self.env = {**env, **fixed, "HOME": "/tmp", "BPO_CWD_FD": "3"}
        memory_backed = f"rw,exec,nosuid,nodev,size={limits.tmp_bytes},mode=1777"
        flags = ["--network", "none", "--tmpfs", f"/tmp:{memory_backed}", "--shm-size", str(limits.tmp_bytes),
                 "--memory", str(memory_bytes), "--memory-swap", str(memory_bytes),
                 "--pids-limit", str(max_processes), "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                 "--ulimit", f"fsize={limits.max_file_bytes}:{limits.max_file_bytes}",
                 "--ulimit", f"nofile={limits.max_open_files}:{limits.max_open_files}", "--ulimit", "core=0",
                 "--log-driver", "none", "--hostname", "sandbox"]
        if cpus > 0:
            flags += ["--cpus", f"{cpus:g}"]
        if read_only_root:
            flags.append("--read-only")
        if uid is not None:
            # the keeper runs as root (out of the agent's reach: it has no capability to signal it); commands as uid
            flags += ["--user", "0:0"]
        self._flags = flags
        self._user = ["-u", f"{uid}:{uid}"] if uid is not None else []
        # a door (and so reuse across runners) needs mounts, i.e. root
        self._doors = os.geteuid() == 0
        self._key = (binary, image, tuple(flags), tuple(sorted(self.env.items())), mount_point)
        self._slot = _Slot(workspace if self._doors else self.workspace, reusable=read_only_root)
        weakref.finalize(self, self._slot.release)
        self._busy = threading.Lock()  # held by run(); kill_all() waits for it before giving the container back
        self._lock = threading.Lock()
        self._running: _CliExec | _ApiExec | None = None
        self._cancelled = False
        self._last_error = ""

    def _container(self) -> _Container:
        container = self._slot.container
        if container is not None:
            return container
        container = _take_idle(self._key) if self._doors else None
        if container is None:
            container = _Container.start(self.binary, self.image, self._flags, self.env, self.mount_point,
                                         None if self._doors else self.workspace, self._key)
        try:
            self._slot.attach(container)
        except BaseException:
            self._slot.container = None
            container.remove()
            raise
        return container

    def run(self, script: str, args: Sequence[str] = (), stdin: bytes | None = None,
            timeout_s: float | None = None, env: Mapping[str, str] | None = None) -> RunResult:
        """Run ``bash -c script bpo *args`` in the container; the script may report a cwd on ``$BPO_CWD_FD``.

        Raises ``OSError`` only when Docker cannot run the command, in a fresh container too (the adapter turns
        it into ``SandboxCrashed``); whatever the script does is its result.
        """
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        with self._busy:
            self._cancelled = False
            for attempt in range(2):
                try:
                    container = self._container()
                except DockerUnavailable as exc:
                    raise OSError(str(exc)) from exc
                outcome = self._exec(container, script, args, stdin, timeout, env)
                if outcome is not None:
                    return outcome
                # docker could not start the command: a container that died or is stuck is replaced once
                self._slot.release(reusable=False)
            raise OSError(f"docker exec in {self.image} failed twice: {self._last_error}")

    def _exec(self, container: _Container, script: str, args: Sequence[str], stdin: bytes | None,
              timeout: float, env: Mapping[str, str] | None) -> RunResult | None:
        argv = ["/bin/bash", "-c", _WRAPPER, "bpo", script, *args]
        extra = {**({"BPO_SWEEP": "1"} if self._user else {}), **(env or {})}
        user = self._user[1] if self._user else None
        keep = (self.max_output_bytes + 1, len(_STARTED) + 4096)
        socket_path = _api_socket(self.binary)
        try:
            if socket_path is not None:
                command: _CliExec | _ApiExec = _ApiExec(socket_path, container.name, argv, user, self.mount_point,
                                                        extra, stdin, keep)
            else:
                command = _CliExec(self.binary, container.name, argv, user, self.mount_point, extra, stdin, keep)
        except _ExecRefused as exc:
            self._last_error = str(exc)
            return None
        with self._lock:
            self._running = command
        timed_out = False
        try:
            timed_out = not command.wait(timeout)
        finally:
            if timed_out or self._cancelled:
                # the client side's end does not stop the command: kill its processes in the container
                if container.sweep() is None:
                    self._sweep_by_exec(container)
                command.abort()
            returncode = command.finish()
            with self._lock:
                self._running = None
        output, report = b"".join(command.out), b"".join(command.err)
        started = report.startswith(_STARTED)
        if not started and not timed_out and not self._cancelled:
            self._last_error = report.decode("utf-8", "replace")[-800:] or f"exit status {returncode}"
            return None
        # nothing the command started outlives it (a daemon that escaped the wrapper's kill, a killed wrapper)
        if container.sweep() is False or (container.pids_dir is None and not self._sweep_by_exec(container)):
            self._slot.release(reusable=False)  # a fresh container for the next command
        reported = report[len(_STARTED):].decode("utf-8", "replace").strip() if started else ""
        killed = timed_out or self._cancelled
        return RunResult(output=output[: self.max_output_bytes], returncode=None if killed else returncode,
                         timed_out=killed, truncated=len(output) > self.max_output_bytes, cwd=reported or None)

    def _sweep_by_exec(self, container: _Container) -> bool:
        """Kill every process of the sandbox uid from inside (where the host cannot see the container's cgroup)."""
        for _ in range(3):
            done = _docker(self.binary, "exec", *self._user, container.name, "/bin/bash", "-c", "kill -9 -1",
                           check=False, timeout_s=30)
            if done.returncode in (0, 1):
                return True
            time.sleep(0.1)
        return False

    def kill_all(self) -> None:
        """Kill the running command with every process it started, wait for its ``run`` to return (as timed out),
        then give the container back (a later ``run`` gets a container again)."""
        with self._lock:
            command = self._running
            self._cancelled = command is not None
        container = self._slot.container
        if command is not None and container is not None:
            if container.sweep() is None:
                self._sweep_by_exec(container)
            command.abort()
        with self._busy:
            self._slot.release()


def build_instance_image(tag: str, repo_dir: str, base_image: str, binary: str = "docker",
                         extra_dockerfile: str = "") -> str:
    """Build ``tag``: ``base_image`` (python3, git, pytest) with ``repo_dir`` copied to ``/testbed`` and put on
    ``sys.path`` the way an editable install does (a ``.pth`` file), as in SWE-bench's instance images. Built
    with no network; skipped when ``tag`` exists already (remove it to rebuild)."""
    if _docker(binary, "image", "inspect", tag, check=False).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="bpo-swe-image-") as context:
        shutil.copytree(repo_dir, os.path.join(context, "testbed"), symlinks=True)
        dockerfile = (f"FROM {base_image}\nCOPY testbed /testbed\nWORKDIR /testbed\n"
                      "RUN site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && "
                      "mkdir -p \"$site\" && echo /testbed > \"$site/testbed.pth\" && "
                      "git config --system --add safe.directory '*' && "
                      # SWE-bench images run a conda Python, which has no sitecustomize of its own (Debian's has)
                      "rm -f /usr/lib/python3*/sitecustomize.py\n" + extra_dockerfile)
        with open(os.path.join(context, "Dockerfile"), "w") as f:
            f.write(dockerfile)
        _docker(binary, "build", "--network", "none", "-q", "-t", tag, context, timeout_s=600)
    return tag
