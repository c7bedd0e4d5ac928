"""Run SWE sandbox commands in an instance's Docker image (SWE-bench's ``swebench/sweb.eval.x86_64.<id>``).

The image provides the toolchain (its conda environment, compilers, the installed repository) and the pristine
``/testbed``. The sandbox's own copy of ``/testbed`` lives on the host, in the same snapshot-able workspace as the
local backend (overlay layers or an in-memory record, on the sandbox's size-limited disk), and is bind-mounted into
a fresh container for every command::

    docker run --rm --network none --read-only --tmpfs /tmp:size=<tmp_bytes> --memory <memory_bytes>
        --memory-swap <memory_bytes> --pids-limit <max_processes> --cpus <cpus> --cap-drop ALL
        --security-opt no-new-privileges --user <uid> -v <workspace>:/testbed -w /testbed <image> bash -c <script>

So there is no network (``--network none``; the daemon itself runs with ``--bridge=none --iptables=false``), the
root file system outside ``/testbed`` and ``/tmp`` is read-only, and memory, processes and CPU are limited for the
whole command (every process it starts is in the container's cgroup). Nothing survives a command but the files
under ``/testbed``: a background process dies with the container, which is what makes a snapshot of the directory
exact, as with the local backend. A command that runs past its time limit is removed with ``docker rm -f``.

:class:`DockerRunner` has the same ``run`` interface as :class:`~sandbox_adapters.swebench.confine.Confinement`,
so the adapter and the grading code use either. :func:`testbed_layer` extracts an image's ``/testbed`` once into a
cache directory keyed by the image id (``docker create`` + ``docker cp``), owned by the sandbox uid; the workspaces
of every sandbox of that image stack on it. :func:`build_instance_image` makes a small instance image from a
generated task on a base image made without any registry (``scripts/setup.sh`` builds one with ``debootstrap``
and ``docker import``), for tests and CI.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Mapping, Sequence

from sandbox_adapters.swebench.confine import Limits, RunResult, chown_tree, deterministic_env
from sandbox_adapters.swebench.workspace import Layer

__all__ = ["DockerRunner", "DockerUnavailable", "docker_available", "testbed_layer", "image_env",
           "build_instance_image", "instance_image_name"]

#: Where a command reports its final directory (a host directory bound per command; see ``DockerRunner.run``).
_CWD_DIR = "/run/bpo"


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


class DockerRunner:
    """Runs scripts in a fresh container of ``image`` with ``workspace`` at ``/testbed``; see the module docstring.

    Args:
        workspace: host directory bound writable at ``mount_point``.
        image: the instance image.
        limits: per-command time, process file size and open files, plus the sandbox budget below.
        memory_bytes, max_processes, cpus: the container's cgroup limits.
        uid: user (and group) the commands run as; None: the image's user.
        mount_point: where the workspace appears (``/testbed`` in SWE-bench images).
        max_output_bytes: how much of the output is kept.
        binary: the docker client.
        read_only_root: mount the image's root file system read-only (``/testbed`` and ``/tmp`` stay writable).
    """

    def __init__(self, workspace: str, image: str, limits: Limits, *, memory_bytes: int, max_processes: int,
                 cpus: float, uid: int | None = 65534, mount_point: str = "/testbed",
                 max_output_bytes: int = 1 << 20, binary: str = "docker", read_only_root: bool = True) -> None:
        if not docker_available(binary):
            raise DockerUnavailable("no Docker engine answers (start one: dockerd --bridge=none --iptables=false)")
        self.workspace, self.image, self.limits = workspace, image, limits
        self.mount_point, self.max_output_bytes, self.binary = mount_point, max_output_bytes, binary
        env = image_env(binary, image)
        fixed = deterministic_env()
        # the image's own PATH (its conda environment); its repository's pytest plugins load as in the harness
        fixed.pop("PATH")
        fixed.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
        self.env = {**env, **fixed, "HOME": "/tmp", "BPO_CWD_FD": "3"}
        flags = ["--rm", "--network", "none", "--tmpfs", f"/tmp:rw,exec,size={limits.tmp_bytes},mode=1777",
                 "--memory", str(memory_bytes), "--memory-swap", str(memory_bytes),
                 "--pids-limit", str(max_processes), "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                 "--ulimit", f"fsize={limits.max_file_bytes}:{limits.max_file_bytes}",
                 "--ulimit", f"nofile={limits.max_open_files}:{limits.max_open_files}", "--ulimit", "core=0",
                 "--log-driver", "none", "--hostname", "sandbox", "-w", mount_point]
        if cpus > 0:
            flags += ["--cpus", f"{cpus:g}"]
        if read_only_root:
            flags.append("--read-only")
        if uid is not None:
            flags += ["--user", f"{uid}:{uid}"]
        self._flags = flags
        self._running: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def run(self, script: str, args: Sequence[str] = (), stdin: bytes | None = None,
            timeout_s: float | None = None, env: Mapping[str, str] | None = None) -> RunResult:
        """Run ``bash -c script bpo *args`` in a fresh container; the script may report a cwd on ``$BPO_CWD_FD``.

        Raises ``OSError`` when the container cannot start (the adapter turns it into ``SandboxCrashed``).
        """
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        name = f"bpo-swe-{uuid.uuid4().hex}"
        report_dir = tempfile.mkdtemp(prefix="bpo-swe-cwd-")
        os.chmod(report_dir, 0o777)
        # stderr joins stdout inside the container, in order; fd 3 is the cwd channel; "started" tells a failure
        # of docker itself (no container ran) from a script that fails
        wrapped = f"exec 2>&1 3>{_CWD_DIR}/cwd\n: > {_CWD_DIR}/started\n{script}"
        command = [self.binary, "run", "--name", name, *self._flags, "-v", f"{self.workspace}:{self.mount_point}",
                   "-v", f"{report_dir}:{_CWD_DIR}"]
        for key, value in {**self.env, **(env or {})}.items():
            command += ["-e", f"{key}={value}"]
        if stdin is not None:
            command.append("-i")
        command += ["--entrypoint", "/bin/bash", self.image, "-c", wrapped, "bpo", *args]
        try:
            with tempfile.TemporaryFile(prefix="bpo-swe-out-") as out:
                proc = subprocess.Popen(command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                with self._lock:
                    self._running[name] = proc
                timed_out = False
                try:
                    proc.communicate(input=stdin, timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    self._remove(name, proc)
                except BaseException:
                    self._remove(name, proc)
                    raise
                finally:
                    with self._lock:
                        self._running.pop(name, None)
                out.seek(0)
                output = out.read(self.max_output_bytes + 1)
            try:
                with open(os.path.join(report_dir, "cwd"), "rb") as f:
                    reported = f.read(4096).decode("utf-8", "replace").strip() or None
            except OSError:
                reported = None
            started = os.path.exists(os.path.join(report_dir, "started"))
        finally:
            shutil.rmtree(report_dir, ignore_errors=True)
        returncode = None if timed_out else proc.returncode
        if not started and not timed_out and returncode != -9:
            raise OSError(f"docker run {self.image} failed: {output.decode('utf-8', 'replace')[-800:]}")
        return RunResult(output=output[: self.max_output_bytes], returncode=returncode, timed_out=timed_out,
                         truncated=len(output) > self.max_output_bytes, cwd=reported)

    def _remove(self, name: str, proc: subprocess.Popen) -> None:
        """Kill and remove the container (killing the client alone would leave the container running)."""
        _docker(self.binary, "rm", "-f", name, check=False, timeout_s=60)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()

    def kill_all(self) -> None:
        """Remove every running container of this runner and wait for their clients to return."""
        with self._lock:
            running = dict(self._running)
        for name, proc in running.items():
            self._remove(name, proc)


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
