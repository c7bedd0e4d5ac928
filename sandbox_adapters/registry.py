"""Name -> adapter class, so configs can say ``bpo.sandbox.name=alfworld``.

Adapters are imported lazily: naming ``textworld`` must not import ALFWorld or SWE-bench. Each adapter class has
a ``Config`` dataclass whose fields (documented there) are the keys accepted under ``bpo.sandbox.config``.
A ``Config`` whose calls have time limits of their own may define ``min_step_timeout_s()``, the longest one reset or
step can take within them; ``bpo.step_timeout_s`` is checked against it before a run starts.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from sandbox_adapters.base import Sandbox

__all__ = ["SANDBOX_REGISTRY", "register_sandbox", "get_sandbox_cls", "check_sandbox_config", "min_step_timeout_s",
           "make_sandbox"]

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
