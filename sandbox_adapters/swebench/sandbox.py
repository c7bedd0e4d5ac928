"""``SWEBenchSandbox``: a repository sandbox graded by the real SWE-bench code, locally or in Docker images.

The agent works in a git checkout of the task's repository, seen at ``/testbed``. Each turn is one action:

* a fenced shell block, run once in a fresh sandboxed ``bash`` (no network, read-only system, limits)::

      ```bash
      pytest -q tests/
      ```

* a whole-file write, which avoids quoting trouble (path relative to the current directory)::

      ```write pkg/module.py
      <the complete new file content>
      ```

* ``submit`` (alone on a line, or as the only line of a bash block): the episode ends and the change is graded.

Shell state does not persist between turns, except the current directory: a ``cd`` in one turn carries over to
the next. So the sandbox state is exactly *the directory plus the cwd*, and a snapshot of the directory
(overlayfs layers or an in-memory record, see ``workspace``) is exact. Observations are the command's
interleaved stdout/stderr with timing strings (``in 0.51s``, ``real 0m0.01s``), memory addresses and clock
timestamps masked, then the exit status.

Backends (``Config.backend``):

* ``"local"``: commands run under bubblewrap on the host's system directories and this interpreter (``confine``).
  Tasks carry ``repo_path``, a local git checkout that contains ``base_commit`` (or it sits at
  ``Config.repos_dir/<instance_id>``); ``tasks`` generates such tasks.
* ``"docker"``: commands run by ``docker exec`` in one long-lived container of the instance's image per sandbox
  (``docker``), cleaned after every command so that only ``/testbed`` carries over: SWE-bench Verified's
  ``swebench/sweb.eval.x86_64.<id>`` images provide the toolchain and ``/testbed``. The image's ``/testbed`` is
  extracted once per image into ``Config.docker_cache_dir`` and the sandbox's workspace (the same overlay or
  memory snapshots as locally) is bind-mounted over it, so a fork costs what it costs locally.
  ``python -m verl_bpo.data.prepare swebench --backend docker`` maps a local copy of the dataset to image names.

Limits (one budget per sandbox, ``limits``): all processes of a sandbox together get ``Config.memory_bytes`` of
memory, ``max_processes`` processes and ``cpus`` CPUs (a cgroup locally, the container's cgroup in Docker); its
``/testbed`` lives on a ``disk_bytes`` filesystem of its own; ``/tmp`` (and in Docker ``/dev/shm``) is a
``tmp_bytes`` tmpfs inside the memory budget; no other folder is writable. ``close()``, also while a command
runs, first kills every process of the sandbox, then deletes its files.
These need root (as SWE sandboxes on this project's machines run); without it (``Config.budget="auto"``) the local
backend falls back to per-process limits, which a multi-process command can exceed.

Faults: whatever an agent command or the code under test does, to the sandbox's own bookkeeping too (the cwd
channel, the shell that runs it, its streams, the container), is the action's outcome: an observation with reward
0. Only faults outside the agent's reach (Docker or the host failing) raise ``SandboxCrashed``, which masks the
turn out of the loss, so no action can use that mask to escape a bad outcome.

Reward: at ``submit``, or when ``Config.max_steps`` actions have been taken, the agent's change is read from the
workspace's files on the host as a text patch against the pristine checkout, without the files that could change
how the tests run (``protected``: tests, runner configuration, start-up modules, packaging metadata, bytecode) or
binary files, and graded on a fresh copy of the pristine checkout with SWE-bench's ``make_test_spec`` +
``get_eval_report`` (``grading``): the instance's ``eval_script`` runs in a fresh sandbox (in its image with the
Docker backend), pytest through the grader's own runner with a canary test. 1.0 when the instance is resolved and
the grader's channels agree, else 0.0; ``info["grading_tampered"]`` marks a run whose results were forged.

Task specification: an instance in the SWE-bench 5 schema (``instance_id``, ``repo``, ``version``,
``base_commit``, ``problem_statement``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``eval_script``, ``log_parser``,
``eval_type``, ``image``, ...), which ``load_swebench_dataset`` reads from a local parquet/JSON copy of a dataset.

Requirements: Linux, ``git`` and ``swebench`` (5.x) for grading; locally ``bwrap`` (Debian ``bubblewrap``),
util-linux ``prlimit``/``setpriv`` and ``pytest`` in the sandbox interpreter; for Docker an engine (Debian
``docker.io``, started as ``dockerd --bridge=none --iptables=false``) holding the instance images.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
import subprocess
import sys
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

from sandbox_adapters.base import (
    Observation,
    Sandbox,
    SandboxCrashed,
    Snapshot,
    SnapshotKind,
    StepResult,
)
from sandbox_adapters.swebench.confine import Confinement, ConfinementUnavailable, Limits, bwrap_path
from sandbox_adapters.swebench.docker import (
    DockerRunner,
    DockerUnavailable,
    docker_available,
    instance_image_name,
    testbed_layer,
)
from sandbox_adapters.swebench.grading import Runner, extract_patch, grade_patch, swebench_available
from sandbox_adapters.swebench.limits import Budget, Cgroup, QuotaDisk, cgroups_available, quota_disks_available
from sandbox_adapters.swebench.workspace import (
    Layer,
    MemoryWorkspace,
    OverlayWorkspace,
    Workspace,
    make_layer,
    overlay_supported,
)

__all__ = ["SWEBenchSandbox", "normalise_output", "parse_swe_action"]

MOUNT_POINT = "/testbed"

# bash: start in the saved cwd, report the final cwd through $BPO_CWD_FD whatever way the command exits.
_COMMAND_WRAPPER = r"""
cd -- "$1" 2>/dev/null || cd /testbed
trap 'pwd >&"$BPO_CWD_FD"' EXIT
eval "$2"
"""

_WRITE_WRAPPER = r"""
cd -- "$1" 2>/dev/null || cd /testbed
mkdir -p -- "$(dirname -- "$2")" && cat > "$2" && echo "Wrote $(wc -c < "$2") bytes to $2."
"""

_CHECKOUT = r"""
git -c advice.detachedHead=false checkout -q -f "$1" && git clean -qfdx
"""

# Nondeterministic fragments of command output, and what replaces them.
_NOISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\bin \d+(?:\.\d+)?s\b(?: \(\d+:\d\d:\d\d\))?"), "in <T>s"),  # pytest, unittest
    (re.compile(r"\b(real|user|sys)(\s+)\d+m\d+[.,]\d+s\b"), r"\1\2<T>"),  # bash `time`
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|µs|us|ns|seconds?|secs?)\b"), "<T>"),
    (re.compile(r"\b\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?: ?[+-]\d{4}|Z)?"), "<timestamp>"),
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "0x<addr>"),  # object reprs (ASLR)
)

_FENCE = re.compile(r"```[ \t]*([A-Za-z]*)[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_SUBMIT_LINE = re.compile(r"^\s*submit\s*$", re.IGNORECASE | re.MULTILINE)
_SHELL_LANGS = frozenset({"", "bash", "sh", "shell", "console"})


def normalise_output(text: str) -> str:
    """``text`` with timing strings, clock timestamps and memory addresses masked (see ``_NOISE``)."""
    for pattern, replacement in _NOISE:
        text = pattern.sub(replacement, text)
    return text


def parse_swe_action(text: str) -> str | None:
    """The first action in a model turn, as a JSON list: ``["bash", cmd]``, ``["write", path, content]`` or
    ``["submit"]``; None when the turn has none. Blocks come first; a bare ``submit`` line counts outside them."""
    for match in _FENCE.finditer(text):
        lang, info, body = match.group(1).lower(), match.group(2).strip(), match.group(3)
        if lang == "write" and info:
            return json.dumps(["write", info, body])
        if lang in _SHELL_LANGS and not info and body.strip():
            if body.strip().lower() == "submit":
                return json.dumps(["submit"])
            return json.dumps(["bash", body.rstrip("\n")])
    if _SUBMIT_LINE.search(_FENCE.sub("", text)):
        return json.dumps(["submit"])
    return None


def _unrunnable(action: list[str]) -> str | None:
    """Why an action cannot be handed to a shell at all (a NUL character in an argument, text that is not valid
    Unicode), or None."""
    # the command or the path is a process argument; a file's content goes through stdin, where NUL is fine
    if any("\x00" in part for part in action[1:2]):
        return "it contains a NUL character"
    try:
        for part in action[1:]:
            part.encode("utf-8")
    except UnicodeEncodeError:
        return "it contains text that is not valid Unicode (a lone surrogate)"
    return None


@dataclasses.dataclass(frozen=True)
class _Payload:
    """A SWE snapshot payload: the directory state (layers/file copy) and the small dict beside it."""

    state: Any
    cwd: str
    steps: int

    def release(self) -> None:
        self.state.release()


class SWEBenchSandbox(Sandbox):
    """Repository sandbox; see the module docstring for actions, state, backends, limits, reward and requirements."""

    @dataclasses.dataclass
    class Config:
        """Keys accepted under ``bpo.sandbox.config`` for ``name=swebench``.

        Attributes:
            backend: ``"local"`` (default: bubblewrap on this host, tasks with local checkouts) or ``"docker"``
                (the commands in a long-lived container of the instance's image).
            repos_dir: directory holding ``<instance_id>/`` checkouts, used by the local backend when a task has
                no ``repo_path`` (default None: every task must carry ``repo_path``).
            docker_image: image of every task (default None: the task's ``image``, else the name the SWE-bench
                harness derives from its ``instance_id``, ``swebench/sweb.eval.x86_64.<id>:latest``).
            docker_cache_dir: where each image's ``/testbed`` is extracted once (default
                ``~/.cache/verl-bpo/swe-testbeds``).
            docker_binary: the docker client (default ``docker``).
            docker_writable_root_at_grading: give the grading containers a writable root file system (thrown
                away with the container) for evaluation scripts that install packages outside ``/testbed``
                (default False: read-only, as for the agent's commands, which always have it read-only).
            snapshot_backend: ``"auto"`` (default: overlayfs when a probe mount succeeds, else in-memory),
                ``"overlay"`` (fail if overlayfs cannot be mounted) or ``"memory"`` (in-memory records).
            max_steps: actions after which the episode ends and is graded as if submitted (default 30; invalid
                turns count too, so a model that never acts still ends).
            command_timeout_s: wall-clock limit of one command (default 30.0); a command that runs longer is
                killed with all its processes and the agent sees a timeout message.
            grading_timeout_s: wall-clock limit of each grading stage in a sandbox: patch application and the
                eval script (default 300.0); an eval that runs longer counts as "Tests Timed Out". (The patch is
                read on the host, bounded by the sandbox's disk.)
            budget: ``"auto"`` (default: one cgroup and one disk quota per sandbox where this process can make
                them, i.e. as root; else per-process limits only) or ``"required"`` (fail without them).
            memory_bytes: memory of the whole sandbox, all its processes and ``/tmp`` together (default 2 GiB);
                also each process's address-space limit.
            max_processes: processes and threads of the whole sandbox at once (default 128; stops fork bombs).
            cpus: CPU time of the whole sandbox, in CPUs (default 1.0; 0 = unlimited).
            disk_bytes: size of the sandbox's own filesystem that holds what it writes to ``/testbed``: the
                overlay's changes (snapshots of the sandbox included), or the whole directory with the memory
                backend (default 2 GiB).
            tmp_bytes: size of ``/tmp`` (memory-backed; counts towards ``memory_bytes``; default 256 MiB).
            max_file_bytes: largest file a sandboxed process may write (default 64 MiB).
            max_snapshot_bytes: changed file contents one in-memory snapshot may hold (default 256 MiB; a larger
                snapshot fails, so the sampler does not fork there).
            max_output_chars: characters of command output shown to the agent; the middle of longer output is
                cut (default 8000).
            sandbox_uid: unprivileged uid/gid that commands run as when this process is root (default 65534,
                "nobody"); the workspace is owned by it.
            python_bin_dir: local backend: directory put first on ``PATH`` inside the sandbox, so
                ``python``/``pytest`` are those of this interpreter (default: the directory of ``sys.executable``).
            extra_ro_paths: local backend: host paths the commands may read besides the system directories and the
                interpreter (default none: the rest of the host, task data and gold patches included, is
                invisible to the agent). Add e.g. a toolchain under ``/opt`` that the repository's tests need.
            max_layers: overlay stack depth above which a snapshot flattens the stack (default 24).
        """

        backend: str = "local"
        repos_dir: str | None = None
        docker_image: str | None = None
        docker_cache_dir: str = dataclasses.field(
            default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "verl-bpo", "swe-testbeds"))
        docker_binary: str = "docker"
        docker_writable_root_at_grading: bool = False
        snapshot_backend: str = "auto"
        max_steps: int = 30
        command_timeout_s: float = 30.0
        grading_timeout_s: float = 300.0
        budget: str = "auto"
        memory_bytes: int = 2 << 30
        max_processes: int = 128
        cpus: float = 1.0
        disk_bytes: int = 2 << 30
        tmp_bytes: int = 256 << 20
        max_file_bytes: int = 64 << 20
        max_snapshot_bytes: int = 256 << 20
        max_output_chars: int = 8000
        sandbox_uid: int = 65534
        python_bin_dir: str = dataclasses.field(default_factory=lambda: os.path.dirname(sys.executable))
        extra_ro_paths: tuple[str, ...] = ()
        max_layers: int = 24

        def __post_init__(self) -> None:
            if self.backend not in ("local", "docker"):
                raise ValueError(f"swebench: backend must be local|docker, got {self.backend!r}")
            if self.snapshot_backend not in ("auto", "overlay", "memory"):
                raise ValueError(
                    f"swebench: snapshot_backend must be auto|overlay|memory, got {self.snapshot_backend!r}")
            if self.budget not in ("auto", "required"):
                raise ValueError(f"swebench: budget must be auto|required, got {self.budget!r}")
            if self.max_steps < 1 or self.max_output_chars < 100 or self.max_layers < 2:
                raise ValueError("swebench: max_steps >= 1, max_output_chars >= 100 and max_layers >= 2 required")
            if min(self.memory_bytes, self.max_processes, self.disk_bytes, self.tmp_bytes) <= 0 or self.cpus < 0:
                raise ValueError("swebench: memory_bytes, max_processes, disk_bytes and tmp_bytes must be > 0 and "
                                 "cpus >= 0")
            self.extra_ro_paths = tuple(self.extra_ro_paths)

        def min_step_timeout_s(self) -> float:
            """The longest a call may take within these limits (``registry.min_step_timeout_s``): the step at
            ``max_steps`` runs a command, then grades (patch reading on the host, application, eval script; a third
            ``grading_timeout_s`` is headroom for the first)."""
            return self.command_timeout_s + 3 * self.grading_timeout_s

    name: ClassVar[str] = "swebench"
    deterministic: ClassVar[bool] = True
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.FILESYSTEM

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = cfg = config or self.Config()
        if cfg.backend == "local" and bwrap_path() is None:
            raise ConfinementUnavailable(
                "SWEBenchSandbox confines commands with bubblewrap; install it (Debian/Ubuntu: apt-get install "
                "bubblewrap)"
            )
        if cfg.backend == "docker" and not docker_available(cfg.docker_binary):
            raise DockerUnavailable("swebench: backend='docker' but no Docker engine answers; start one with "
                                    "`dockerd --bridge=none --iptables=false` (Debian package docker.io)")
        backend = cfg.snapshot_backend
        if backend == "auto":
            backend = "overlay" if overlay_supported() else "memory"
        elif backend == "overlay" and not overlay_supported():
            raise RuntimeError("swebench: snapshot_backend='overlay' but this process cannot mount overlayfs "
                               "(it needs root / CAP_SYS_ADMIN); use 'memory' or 'auto'")
        self.backend = backend
        self.has_budget = cgroups_available() and quota_disks_available()
        if cfg.budget == "required" and not self.has_budget:
            raise RuntimeError("swebench: budget='required' but this process cannot make cgroups and loop-mounted "
                               "disks (it needs root); use budget='auto' for per-process limits only")
        self.uid = cfg.sandbox_uid if os.geteuid() == 0 else None
        self.limits = Limits(
            timeout_s=cfg.command_timeout_s,
            memory_bytes=cfg.memory_bytes,
            max_processes=cfg.max_processes,
            max_file_bytes=cfg.max_file_bytes,
            tmp_bytes=cfg.tmp_bytes,
        )
        self.budget = Budget(cfg.memory_bytes, cfg.max_processes, cfg.cpus, cfg.disk_bytes, cfg.tmp_bytes)
        self._workspace: Workspace | None = None
        self._runner: Runner | None = None
        self._cgroup: Cgroup | None = None
        # a sandbox dropped without close() must not leave a process, mount or temp dir behind
        self._resources = _Resources()
        weakref.finalize(self, self._resources.close)
        self._cwd = MOUNT_POINT
        self._steps = 0

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return (
            "You are a software engineer fixing an issue in a Python repository checked out at /testbed. "
            "Each reply must contain exactly one action:\n"
            "- a shell command in a ```bash block (it runs in a fresh shell without network; only `cd` carries "
            "over to the next turn),\n"
            "- a complete new file content in a ```write <path> block,\n"
            "- or the word submit on its own line when the issue is fixed.\n"
            "Your changes are graded by the repository's tests after you submit."
        )

    def first_user_message(self, observation: Observation) -> str:
        return observation.text

    def invalid_action_text(self, text: str) -> str:
        return ("No action found. Reply with one ```bash block, one ```write <path> block, or `submit` on its "
                "own line.")

    def parse_action(self, text: str) -> str | None:
        return parse_swe_action(text)

    # --- engine hooks ---------------------------------------------------------------------------------------
    def _image(self, task: Mapping[str, Any]) -> str:
        return self.config.docker_image or instance_image_name(task)

    def _make_runner(self, directory: str | Workspace, max_output_bytes: int | None = None,
                     grading: bool = False) -> Runner:
        """A runner for ``directory`` (a path, or the workspace: a Docker container then follows its remounts) at
        ``/testbed``; agent commands keep a few times what is shown, grading all."""
        cfg = self.config
        keep = max_output_bytes or 4 * cfg.max_output_chars + 4096
        if cfg.backend == "docker":
            runner: Runner = DockerRunner(
                directory, self._image(self.task), self.limits, memory_bytes=cfg.memory_bytes,
                max_processes=cfg.max_processes, cpus=cfg.cpus, uid=self.uid, mount_point=MOUNT_POINT,
                max_output_bytes=keep, binary=cfg.docker_binary,
                read_only_root=not (grading and cfg.docker_writable_root_at_grading))
        else:
            runner = Confinement(
                getattr(directory, "path", directory), self.limits, uid=cfg.sandbox_uid, mount_point=MOUNT_POINT,
                path_prefix=[cfg.python_bin_dir], extra_ro_paths=[cfg.python_bin_dir, *cfg.extra_ro_paths],
                max_output_bytes=keep, cgroup=self._cgroup)
        self._resources.runners.add(runner)
        return runner

    def _make_grading_runner(self, directory: str) -> Runner:
        return self._make_runner(directory, max_output_bytes=self.config.max_file_bytes, grading=True)

    def _ensure_workspace(self) -> Workspace:
        if self._workspace is None:
            cfg = self.config
            if self.has_budget and cfg.backend == "local" and self._cgroup is None:
                self._cgroup = self._resources.cgroup = Cgroup(self.budget)
            disk = QuotaDisk(cfg.disk_bytes) if self.has_budget else None
            if self.backend == "overlay":
                self._workspace = OverlayWorkspace(self.uid, cfg.max_layers, disk)
            else:
                self._workspace = MemoryWorkspace(self.uid, disk, cfg.max_snapshot_bytes)
            self._resources.workspaces.append(self._workspace)
        return self._workspace

    def _repo_path(self, task: Mapping[str, Any]) -> str:
        path = task.get("repo_path")
        if path is None and self.config.repos_dir is not None:
            path = os.path.join(self.config.repos_dir, task["instance_id"])
        if path is None or not os.path.isdir(os.path.join(path, ".git")):
            raise ValueError(f"swebench: task {task.get('instance_id')!r} has no local git checkout "
                             f"(repo_path={path!r}); set task['repo_path'] or Config.repos_dir, or use "
                             "backend='docker' with the instance's image")
        return path

    def _origin(self, task: Mapping[str, Any]) -> Layer:
        """The task's pristine ``/testbed`` as a layer (the caller releases it)."""
        if self.config.backend == "docker":
            return testbed_layer(self._image(task), self.uid, self.config.docker_cache_dir,
                                 self.config.docker_binary).acquire()
        origin = make_layer(self._repo_path(task), self.uid).acquire()
        try:
            checkout = self._make_runner(origin.path).run(
                _CHECKOUT, [task["base_commit"]], timeout_s=self.config.grading_timeout_s)
        except BaseException:
            origin.release()
            raise
        if checkout.returncode != 0:
            origin.release()
            raise SandboxCrashed(f"swebench: cannot check out {task['base_commit']}: "
                                 f"{checkout.output.decode('utf-8', 'replace')[-2000:]}")
        return origin

    def _reset(self, task: Mapping[str, Any]) -> Observation:
        if not task.get("eval_script"):
            # a classic row (SWE-bench Verified as published) that did not come through `prepare`: derive what
            # the grader reads, or refuse here with the missing field named rather than at the first submit
            from sandbox_adapters.swebench.verified import complete_instance

            task = self._task = complete_instance(task, setup=self.config.backend == "docker")
        workspace = self._ensure_workspace()
        try:
            origin = self._origin(task)
            try:
                workspace.load(origin)
            finally:
                origin.release()  # the workspace holds its own reference
            self._runner = self._make_runner(workspace)
        except (OSError, subprocess.SubprocessError, DockerUnavailable) as exc:
            raise SandboxCrashed(f"swebench: reset failed: {exc!r}") from exc
        self._cwd = MOUNT_POINT
        self._steps = 0
        text = (f"Repository {task['repo']} (instance {task['instance_id']}) is checked out at {MOUNT_POINT}.\n\n"
                f"Issue:\n{task['problem_statement'].strip()}\n")
        return Observation(text, {"instance_id": task["instance_id"]})

    def _shorten(self, text: str) -> str:
        limit = self.config.max_output_chars
        if len(text) <= limit:
            return text
        half = limit // 2
        return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"

    def _run_action(self, action: list[str]) -> tuple[str, dict[str, Any]]:
        assert self._runner is not None
        if action[0] == "bash":
            result = self._runner.run(_COMMAND_WRAPPER, [self._cwd, action[1]])
            cwd = result.cwd
            if cwd and (cwd == MOUNT_POINT or cwd.startswith(MOUNT_POINT + "/")):
                self._cwd = posixpath.normpath(cwd)
        else:
            result = self._runner.run(_WRITE_WRAPPER, [self._cwd, action[1]], stdin=action[2].encode())
        output = normalise_output(result.output.decode("utf-8", "replace"))
        if result.truncated:
            output += "\n[... output truncated ...]"
        info: dict[str, Any] = {}
        if result.timed_out:
            info["timed_out"] = True
            status = (f"[command timed out after {self.limits.timeout_s:g}s; it and every process it started were "
                      "killed]")
        else:
            status = f"[exit code {result.returncode}]"
        return f"{self._shorten(output)}\n{status}".lstrip("\n"), info

    def _grade(self) -> tuple[float, dict[str, Any], str]:
        if not swebench_available():
            raise RuntimeError("swebench: grading needs the `swebench` package (pip install swebench==5.0.2, "
                               "part of the `envs` extra)")
        assert self._workspace is not None and self._workspace.origin
        task = self.task
        # the patch is read from the workspace's files on the host, never by a program the agent could configure
        extracted = extract_patch(self._workspace.path, self._workspace.origin.path, task.get("eval_script", ""))
        graded = grade_patch(task, extracted.patch, self._workspace.origin.path, self._make_grading_runner,
                             self.uid, self.config.grading_timeout_s)
        status = graded.report.get("tests_status", {})
        excluded = list(extracted.excluded)
        info = {
            "resolved": graded.resolved,
            "patch_applied": bool(graded.report.get("patch_successfully_applied")),
            "fail_to_pass_failures": len(status.get("FAIL_TO_PASS", {}).get("failure", [])),
            "pass_to_pass_failures": len(status.get("PASS_TO_PASS", {}).get("failure", [])),
            "excluded_files": excluded,
            "grading_tampered": graded.tampered,
            "won": graded.resolved,
        }
        text = (f"Submitted. The issue is {'resolved' if graded.resolved else 'not resolved'} "
                f"({info['fail_to_pass_failures']} failing FAIL_TO_PASS test(s), "
                f"{info['pass_to_pass_failures']} failing PASS_TO_PASS test(s)).")
        if excluded:
            text += (f" Not graded (tests, test configuration, start-up hooks, binary and bytecode files are left "
                     f"as they were): "
                     f"{', '.join(excluded[:20])}{' ...' if len(excluded) > 20 else ''}.")
        if graded.tampered:
            text += " The test run was tampered with: graded as not resolved."
        return (1.0 if graded.resolved else 0.0), info, text

    def _finish(self, text: str, info: dict[str, Any]) -> StepResult:
        """The step's result: graded and final at ``max_steps``, else reward 0 and the episode goes on."""
        if self._steps < self.config.max_steps:
            return StepResult(Observation(text), 0.0, False, info)
        reward, grade_info, grade_text = self._grade()
        return StepResult(Observation(f"{text}\n\nStep limit reached. {grade_text}"), reward, True,
                          {**info, **grade_info, "step_limit": True})

    def _apply(self, action: str) -> StepResult:
        decoded = json.loads(action)
        self._steps += 1
        unrunnable = _unrunnable(decoded)
        if unrunnable:  # the agent's text, not a fault: an observation like any failed command
            return self._finish(f"[not run: {unrunnable}]", {"unrunnable": True})
        try:
            if decoded[0] == "submit":
                reward, info, text = self._grade()
                return StepResult(Observation(text), reward, True, info)
            return self._finish(*self._run_action(decoded))
        except (OSError, subprocess.SubprocessError, DockerUnavailable) as exc:
            raise SandboxCrashed(f"swebench: the sandbox failed: {exc!r}") from exc

    def _step_text(self, action_text: str) -> StepResult:
        result = super()._step_text(action_text)
        if not result.info.get("invalid_action"):
            return result
        # invalid turns count towards max_steps too, so a model that never acts still ends the episode
        self._steps += 1
        try:
            return self._finish(result.observation.text, dict(result.info))
        except (OSError, subprocess.SubprocessError, DockerUnavailable) as exc:
            raise SandboxCrashed(f"swebench: the sandbox failed: {exc!r}") from exc

    # --- snapshots ------------------------------------------------------------------------------------------
    def _snapshot_payload(self) -> _Payload:
        if self._workspace is None:
            raise RuntimeError("swebench: snapshot() before reset()")
        return _Payload(self._workspace.snapshot(), self._cwd, self._steps)

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        return dataclasses.replace(snap, release=snap.payload.release)

    def _restore_payload(self, snapshot: Snapshot) -> None:
        payload = snapshot.payload
        if not isinstance(payload, _Payload):
            raise TypeError(f"swebench: not a SWEBenchSandbox snapshot payload: {type(payload).__name__}")
        self._task = dict(snapshot.task)  # the runner needs the task's image
        self._ensure_workspace().restore(payload.state)
        if self._runner is None:
            self._runner = self._make_runner(self._workspace)
        self._cwd = payload.cwd
        self._steps = payload.steps

    def close(self) -> None:
        """Kill every process of the sandbox (also of a command still running), then delete its files."""
        self._resources.close()
        self._workspace = None
        self._runner = None
        self._cgroup = None


class _Resources:
    """What a sandbox must release: running commands first, then its cgroup, then its workspaces."""

    def __init__(self) -> None:
        self.runners: weakref.WeakSet[Runner] = weakref.WeakSet()
        self.cgroup: Cgroup | None = None
        self.workspaces: list[Workspace] = []

    def close(self) -> None:
        for runner in list(self.runners):
            runner.kill_all()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        while self.workspaces:
            self.workspaces.pop().close()
