"""Sandbox adapters for BPO: one snapshot/fork protocol (``base``) and engines registered by name (``registry``).

No verl import anywhere in this package.
"""

from sandbox_adapters.base import (
    Observation,
    RestoreFailed,
    Sandbox,
    SandboxCrashed,
    SandboxError,
    SandboxTimeout,
    Snapshot,
    SnapshotKind,
    StepResult,
)
from sandbox_adapters.registry import SANDBOX_REGISTRY, get_sandbox_cls, make_sandbox, register_sandbox

__all__ = [
    "Observation",
    "RestoreFailed",
    "Sandbox",
    "SandboxCrashed",
    "SandboxError",
    "SandboxTimeout",
    "Snapshot",
    "SnapshotKind",
    "StepResult",
    "SANDBOX_REGISTRY",
    "get_sandbox_cls",
    "make_sandbox",
    "register_sandbox",
]
