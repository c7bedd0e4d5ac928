"""Name -> adapter class, so configs can say ``bpo.sandbox.name=alfworld``.

Adapters are imported lazily: naming ``textworld`` must not import ALFWorld or SWE-bench. Each adapter class has
a ``Config`` dataclass whose fields (documented there) are the keys accepted under ``bpo.sandbox.config``.
A ``Config`` whose calls have time limits of their own may define ``min_step_timeout_s()``, the longest one reset or
step can take within them; ``bpo.step_timeout_s`` is checked against it before a run starts.

Two more checks run before a run starts, without starting any engine (``verl_bpo.integration.settings``):
:func:`check_task` (a dataset row's task has what the adapter's ``reset`` reads) and :func:`check_runtime` (the
binaries and daemons the adapter needs are on this node). An adapter class may define either itself, as a
classmethod ``check_task(task, config)`` / ``check_runtime(config)`` taking its built ``Config``; it raises
``ValueError`` (task) or returns a sentence saying what is missing (runtime), ``None`` when all is there.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import socket
from collections.abc import Callable, Mapping
from typing import Any

from sandbox_adapters.base import Sandbox

__all__ = ["SANDBOX_REGISTRY", "register_sandbox", "get_sandbox_cls", "check_sandbox_config", "min_step_timeout_s",
           "make_sandbox", "check_task", "check_runtime", "SandboxRuntimeMissing", "TASK_KEYS"]

# name -> "module:Class"; adapters in this package are listed here, others call register_sandbox().
SANDBOX_REGISTRY: dict[str, str | type[Sandbox]] = {
    "smoke": "sandbox_adapters.smoke:SmokeSandbox",
    "signpost": "sandbox_adapters.signpost:SignpostSandbox",
    "textworld": "sandbox_adapters.textworld:TextWorldSandbox",
    "alfworld": "sandbox_adapters.alfworld:ALFWorldSandbox",
    "swebench": "sandbox_adapters.swebench:SWEBenchSandbox",
    "webshop": "sandbox_adapters.webshop:WebShopSandbox",
}


def register_sandbox(name: str):
    """Class decorator that adds a user adapter to the registry under ``name``."""

    def decorator(cls: type[Sandbox]) -> type[Sandbox]:
        existing = SANDBOX_REGISTRY.get(name)
        if existing is not None and existing is not cls and not isinstance(existing, str):
            raise ValueError(f"sandbox {name!r} is already registered to {existing!r}")
        cls.name = name
        SANDBOX_REGISTRY[name] = cls
        return cls

    return decorator


def get_sandbox_cls(name: str) -> type[Sandbox]:
    if name not in SANDBOX_REGISTRY:
        raise ValueError(
            f"bpo.sandbox.name={name!r} is not a registered sandbox; choose one of {sorted(SANDBOX_REGISTRY)} "
            "or register your adapter with sandbox_adapters.registry.register_sandbox"
        )
    entry = SANDBOX_REGISTRY[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        SANDBOX_REGISTRY[name] = entry
    return entry


def check_sandbox_config(name: str, config: Mapping[str, Any] | None = None) -> Any:
    """The adapter's ``Config`` built from ``config`` (``None`` for adapters without one), without starting any
    engine: an unknown name, an unknown key or a bad value fails here with the field named."""
    cls = get_sandbox_cls(name)
    config_cls = getattr(cls, "Config", None)
    config = dict(config or {})
    if config_cls is None:
        if config:
            raise ValueError(f"bpo.sandbox.config: sandbox {name!r} takes no config keys, got {sorted(config)}")
        return None
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(
            f"bpo.sandbox.config: unknown key(s) {unknown} for sandbox {name!r}; valid keys: {sorted(known)}"
        )
    return config_cls(**config)


def min_step_timeout_s(name: str, config: Mapping[str, Any] | None = None) -> float:
    """The shortest ``bpo.step_timeout_s`` under which no reset or step of this sandbox fails for running within its
    own limits: ``Config.min_step_timeout_s()`` for an adapter whose calls have time limits of their own (a command
    timeout, a grading timeout), else 0."""
    built = check_sandbox_config(name, config)
    method = getattr(built, "min_step_timeout_s", None)
    return float(method()) if callable(method) else 0.0


def make_sandbox(name: str, config: Mapping[str, Any] | None = None) -> Sandbox:
    """Build the adapter ``name`` from the keys of ``config`` (its ``Config`` dataclass fields)."""
    built = check_sandbox_config(name, config)
    cls = get_sandbox_cls(name)
    return cls() if built is None else cls(built)


# --- tasks ------------------------------------------------------------------------------------------------------
# The task keys each adapter of this package reads at reset (its module docstring's "Task specification"): every key
# of the first tuple, and at least one of the second when it is not empty. A task that lacks them fails its reset
# (a KeyError inside the workers), which fails every leaf of its tree: zero advantage, a silent zero gradient.
TASK_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "smoke": (("task_id",), ()),
    "signpost": (("task_id",), ()),
    "textworld": ((), ("game", "task_id")),
    "alfworld": ((), ("game", "task_id")),
    "webshop": (("goal_index",), ()),
    # repo, problem_statement and base_commit are read too; they are not required here because the recipe tests'
    # placeholder rows (tests/test_recipes.py) carry only the id. A real instance always has them.
    "swebench": (("instance_id",), ()),
}
_INTEGER_KEYS = ("task_id", "goal_index")  # the resets read them with int()


def check_task(name: str, task: Any, config: Mapping[str, Any] | None = None) -> None:
    """Raise ``ValueError`` when sandbox ``name`` (with ``config``) cannot reset to ``task``: not a non-empty mapping,
    a key its reset reads missing (:data:`TASK_KEYS`, or the adapter's own ``check_task``), an id that is not an
    integer, or a ``task_id`` outside ``[0, Config.num_tasks)``. Cheap: nothing is started or read from disk."""
    if not isinstance(task, Mapping) or not task:
        raise ValueError(f"the task must be a non-empty mapping, got {task!r}")
    cls = get_sandbox_cls(name)
    built = check_sandbox_config(name, config)
    own = getattr(cls, "check_task", None)
    if callable(own):
        own(task, built)
        return
    required, any_of = TASK_KEYS.get(name, ((), ()))
    missing = [key for key in required if key not in task]
    if missing or (any_of and not any(key in task for key in any_of)):
        wanted = [*required, *([" or ".join(any_of)] if any_of else [])]
        raise ValueError(f"sandbox {name!r} needs a task with {wanted}, got keys {sorted(task)}")
    for key in _INTEGER_KEYS:
        if key in task and name in TASK_KEYS:
            try:
                value = int(task[key])
            except (TypeError, ValueError):
                raise ValueError(f"sandbox {name!r}: task {key}={task[key]!r} is not an integer") from None
            limit = getattr(built, "num_tasks", None)
            if key == "task_id" and isinstance(limit, int) and not 0 <= value < limit:
                raise ValueError(f"sandbox {name!r}: task_id={value} is outside [0, {limit}) (its config's "
                                 "num_tasks)")


# --- runtimes ---------------------------------------------------------------------------------------------------
class SandboxRuntimeMissing(RuntimeError):
    """A binary or daemon a sandbox needs is missing on this node (the message names the node and the fix)."""


def _swebench_runtime(built: Any) -> str | None:
    """What ``SWEBenchSandbox`` needs besides its config: the confinement binaries (local) or a Docker engine
    (docker), and git + the ``swebench`` package for grading. The same probes its constructor and grader use."""
    from sandbox_adapters.swebench.confine import bwrap_path
    from sandbox_adapters.swebench.docker import docker_available
    from sandbox_adapters.swebench.grading import swebench_available

    missing = []
    if built.backend == "local":
        missing += [what for what, found in (
            ("bubblewrap (`bwrap`; Debian/Ubuntu: apt-get install bubblewrap)", bwrap_path()),
            ("util-linux `prlimit`", shutil.which("prlimit")), ("util-linux `setpriv`", shutil.which("setpriv")),
        ) if found is None]
    elif not docker_available(built.docker_binary):
        missing.append(f"a Docker engine answering `{built.docker_binary} info` (Debian: apt-get install docker.io, "
                       "started as `dockerd --bridge=none --iptables=false`)")
    if shutil.which("git") is None:
        missing.append("`git` (grading diffs the repository)")
    if not swebench_available():
        missing.append("the `swebench` package (pip install swebench==5.0.2, the `envs` extra) for grading")
    return f"backend={built.backend} needs {'; '.join(missing)}" if missing else None


# name -> the runtime probe of an adapter of this package that defines none itself.
_RUNTIME_CHECKS: dict[str, Callable[[Any], str | None]] = {"swebench": _swebench_runtime}


def check_runtime(name: str, config: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`SandboxRuntimeMissing` naming this node (``socket.gethostname()``) when a binary or daemon that
    sandbox ``name`` needs with ``config`` is missing here (bubblewrap for the local SWE-bench backend, a Docker
    engine for its docker backend, ...). Probes only, no sandbox is built; cheap enough for every worker start."""
    cls = get_sandbox_cls(name)
    built = check_sandbox_config(name, config)
    probe = getattr(cls, "check_runtime", None)
    probe = probe if callable(probe) else _RUNTIME_CHECKS.get(name)
    problem = probe(built) if probe is not None else None
    if problem:
        raise SandboxRuntimeMissing(
            f"sandbox {name!r} cannot run on node {socket.gethostname()!r}: {problem}. Install it on every node "
            "that runs rollouts (verl's agent-loop workers)"
        )
